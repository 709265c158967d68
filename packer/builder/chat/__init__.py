"""Conversations (chat SFT, LLaVA-style instruction tuning, DPO pairs) as a build packs them: each
record's messages rendered once with the model's chat template as transformers renders it
(`template`), tokenized with the build's tokenizer, and a loss mask of the assistant's tokens
beside the tokens (`encode`); its images decoded as an image build decodes them. Records come
from JSONL, JSON lists and Parquet tables (`scan`), read in the worker that packs them.
"""
