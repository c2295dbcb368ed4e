"""`deepspeed.moe`: refused on import. zerodp is data parallel only; a mixture of experts needs
expert parallelism (experts placed on different ranks, all-to-all token routing), which it has not."""

raise ImportError("deepspeed.moe (mixture of experts) is not supported by zerodp.deepspeed: zerodp is data "
                  "parallel only and has no expert parallelism (experts on different ranks, all-to-all "
                  "routing); train a dense model, or an MoE model whose experts are ordinary modules that every "
                  "rank holds (zerodp then shards their parameters like any other)")
