"""The model names the job knows, without importing torch: `--help` and option checks read them
before any heavy import (gpt.py builds the GPTs, build.py the Hugging Face ones)."""

# Named sizes. "tiny" is for tests, "small" trains visibly in minutes on a laptop CPU (byte-level
# vocabulary), the rest are the GPT-3 paper's table (Brown et al. 2020, table 2.1) at GPT-2's
# vocabulary and a 1024-token context (the paper used 2048: pass block_size=2048 to get it).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64),
    "small": dict(n_layer=6, n_head=8, n_embd=256, vocab_size=256, block_size=256),
    "125M": dict(n_layer=12, n_head=12, n_embd=768),
    "350M": dict(n_layer=24, n_head=16, n_embd=1024),
    "760M": dict(n_layer=24, n_head=16, n_embd=1536),
    "1.3B": dict(n_layer=24, n_head=32, n_embd=2048),
    "2.7B": dict(n_layer=32, n_head=32, n_embd=2560),
    "6.7B": dict(n_layer=32, n_head=32, n_embd=4096),
    "13B": dict(n_layer=40, n_head=40, n_embd=5120),
    # The ZeRO paper's largest runs (ZeRO-2 with 16-way Megatron tensor parallelism): width 8192, with
    # the depths that give its 100B and 170B (12·L·h² + the embeddings); `zerodp estimate --tp 16` plans them.
    "100B": dict(n_layer=125, n_head=64, n_embd=8192),
    "170B": dict(n_layer=212, n_head=64, n_embd=8192),
}

HF_MODELS = ("hf-gpt2", "hf-llama")
