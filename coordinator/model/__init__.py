"""The forward pass, readable apart from the executor that runs it (coordinator/runtime/).

    transformer.py        Transformer: embeddings, norms, attention with its KVCache, the head
                          (LmHead); the FFN and the head's split are objects passed in
    torch_layers.py       its torch side, imported only where a layer needs it
    predictor.py          PowerInfer's per-layer predictors: which FFN neurons a token will use
"""
