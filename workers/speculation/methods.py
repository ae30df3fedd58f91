"""The draft methods by name (a speculation word, so the target and the launchers read it too): the one list behind the draft worker's ``--draft-method`` and the
launchers' (``tandem up``, ``tandem ray up``). Plain names only, so a launcher can import it cheaply."""

HEAD_METHODS = ("eagle3", "eagle", "medusa", "mlp_speculator")  # heads on the target's hidden states
METHODS = ("ngram", "suffix", "draft_model", *HEAD_METHODS)  # what a deployment drafts with
BENCH_METHODS = ("oracle",)  # benchmarks only: replays known outputs
DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype of a model-based draft (auto: bf16 on CUDA)
