"""`python -m replayquant.data`: print the path of the held-out books as plain JSONL."""

from replayquant.data import heldout_path

print(heldout_path())
