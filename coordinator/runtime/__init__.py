"""The executor and the processes: what builds and runs the model (coordinator/model/) across the
coordinator and its workers.

    engine.py             Engine: prefill, decode, generate; engine_build.py builds it from
                          EngineOptions (engine_options.py)
    worker_pool.py        the workers' processes (reaper.py: what a killed run leaves behind)
    placement.py          which process owns which neurons, threads, shares
    memory_plan.py        what a run will hold against what is available
    decode_plan.py        which path a decoded token takes; its steps: sparse_ffn.py,
                          attention_split.py, lockstep_decode.py, all posted by posted_step.py
    batching.py           continuous batching (the server's and the terminal chat's scheduler)
    sampling.py           the next token from the logits
    sparsity_level.py     the sparsity level a run decodes at when none is asked for
    model_files.py        the files beside a model; model_fetch.py `sparseinfer pull`
    interrupts.py         how the process stops on SIGTERM/SIGINT
"""
