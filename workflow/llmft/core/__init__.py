"""What two or more stages share: config, run layout, node facts, launch, chat templates, tokenizing."""
