"""Models: tiny ones built locally with locally trained tokenizers (tiny.py, no hub access), and hub ids
fetched into the Hugging Face cache once per node (hub.py)."""
