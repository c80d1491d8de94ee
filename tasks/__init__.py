"""Downstream tasks on top of a pretrained checkpoint (Megatron-LM's ``tasks/``), run with
``tasks/main.py --task NAME``: see :mod:`tasks.registry` for the tasks and how to add one."""
