"""What LLaMA-Factory does, done the same way outside it: its chat templates (chosen for a folder,
rendered, as data for evaluation), its tokenizing and dataset_info.json entries, the names it accepts."""
