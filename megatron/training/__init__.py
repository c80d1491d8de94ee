"""The training loop: pretrain(), schedules of learning rate and batch size, logging, checkpoints."""
