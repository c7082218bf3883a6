"""matrixopt inside training frameworks: :mod:`matrixopt.integrations.hf` (Hugging Face ``Trainer``, Accelerate
with FSDP2), :mod:`matrixopt.integrations.lightning` (Lightning) and :mod:`matrixopt.integrations.torchtitan`
(torchtitan's optimizers container, FSDP2 and TP). Each module imports its framework only when used;
``import matrixopt`` imports none of them.
"""
