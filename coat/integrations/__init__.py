"""Where coat meets the libraries it plugs into: subclasses of transformers' classes made at
convert time (``transformers.py``) and the one patch of transformers' code (``packed_check.py``).
The FP8 blocks (``coat.nn``) and the model families (``coat.models``) know neither."""
