"""Train a model from the zoo: `python train.py [overrides]` or `torchrun --nproc_per_node=N train.py [overrides]`."""
from loka_trainer.launch import main

if __name__ == "__main__":
    main()
