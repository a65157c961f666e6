"""The byte bigram family: its model, file format, inline engine, row cache, trainer and the
default weights shipped in ``default/``."""
