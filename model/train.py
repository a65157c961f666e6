"""`python -m model.train`: the trainer's command line (the bigram's, in model.bigram.train)."""

import sys

from model.bigram.train import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m model.train"))
