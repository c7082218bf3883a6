"""matrixopt inside training frameworks: :mod:`matrixopt.integrations.hf` (Hugging Face ``Trainer``, Accelerate
with FSDP2) and :mod:`matrixopt.integrations.lightning` (Lightning). Each module imports its framework only when
used; ``import matrixopt`` imports neither.
"""
