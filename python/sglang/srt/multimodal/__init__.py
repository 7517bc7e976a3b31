"""Image inputs: decoding and processing on the tokenizer side (`processor.py`), and what a request
carries to the model (`inputs.py`)."""
