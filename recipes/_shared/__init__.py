"""Code the three pretraining recipes share: corpus, tokenizer, packing, objectives, and the training loop.

The recipes import it as ``_shared`` (the recipes folder is the script's own directory, so it is first on
``sys.path`` under ``python recipes/x.py`` and ``accelerate launch recipes/x.py`` alike).
"""
