"""`python -m model.convert`: the converter's command line (llama2.c, in model.llama.formats.convert)."""

import sys

from model.llama.formats.convert import main

if __name__ == "__main__":
    sys.exit(main())
