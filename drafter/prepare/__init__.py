"""The prompt corpus: sources (files, datasets, ShareGPT) normalised to one conversation shape."""
