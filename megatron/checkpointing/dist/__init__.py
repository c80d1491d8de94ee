"""Megatron-Core's ``torch_dist`` checkpoint format on top of ``torch.distributed.checkpoint``:
``keys`` maps our parameters onto Megatron-Core's global keys, shapes and chunks; ``storage``
reads and writes the directory; ``training`` saves and loads a training run's state (model
chunks, optimizer, RNG, args, iteration) at any parallel layout; ``async_save`` writes in the
background.
"""
