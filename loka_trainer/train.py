"""Train a model from the zoo: ``python -m loka_trainer.train [overrides]``, ``torchrun --nproc_per_node=N -m
loka_trainer.train [overrides]``, or the ``loka-train`` console script; the configs ship in ``loka_trainer/conf``."""
from loka_trainer.launch import script_main

if __name__ == "__main__":
    script_main()
