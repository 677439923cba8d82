"""Training scripts of the embedded default model family (`python -m specdec.train --help`)."""
