"""The preference stage (DPO, ORPO, SimPO, KTO; config key preference): its data (pairs or KTO rows:
read, validate, dedup, split, tokenize), its training objective for sft's planner and renderer (two
sequences a row, a resident reference model, the logits a preference loss keeps), the padding-free DPO
forward its workers install, its evaluation on held-out pairs, its section of the run's page, and its
CLI commands. It imports llmft.core and itself only; the CLI and the training worker put it together
with sft's machinery.
"""
