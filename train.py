"""Train from a source checkout: `python train.py [overrides]` or `torchrun --nproc_per_node=N train.py [overrides]`
(the same as ``python -m loka_trainer.train``)."""
from loka_trainer.launch import script_main

if __name__ == "__main__":
    script_main()
