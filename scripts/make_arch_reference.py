"""Build the transformers oracle for the tiny architecture fixtures (tests/fixtures/tiny_arch.py).

For each architecture the transformers model class is built from the fixture's config and loaded
with the fixture's own seeded weights (its HF-layout state dict: the GGUF the tests run is those
weights put through the converter's transformations). Greedy decoding recomputes the whole
sequence at every step (no cache: nothing of transformers' cache handling is trusted), float32,
eager attention. Writes

  tests/fixtures/arch_reference.json       per arch: prompts, greedy ids, versions; for READBACK,
                                           the tiny file read back by transformers' GGUF loader
  tests/fixtures/arch_reference_logits.npz logits of every position of prompt 0 + its continuation

PowerInfer's files (POWERINFER): bamboo is MistralForCausalLM with ReLU whose MLP is made
symmetric as PowerInfer's llama.cpp computes LLM_ARCH_BAMBOO (LLM_FFN_SYM: relu(gate x) *
relu(up x)); relufalcon is FalconForCausalLM with activation "relu". Besides the dense run, a
"predicted" run: the prompt dense (the engine's prefill), every later position with the FFN
neurons the file's predictor picks (fc2 relu(fc1 h) > powerinfer.sparse_threshold = 0; h the
residual before post_attention_layernorm for bamboo, the layer's input for falcon), the rest
zeroed: keys `<arch>.predicted` (ids) and `<arch>.predicted` logits (positions of prompt 0's
last token and its continuation), with the smallest |score| met (a flip margin).

Run it where transformers is installed (not a test dependency):
  python3 scripts/make_arch_reference.py            # every architecture
  python3 scripts/make_arch_reference.py granite    # one, merged into the committed files
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fixtures.tiny_arch import ARCHS, MOE, OAI, POWERINFER, gguf_tensors, hf_config, hf_weights  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
N_NEW = 16
# Token ids of the tiny byte-level vocabulary; the first runs past every sliding window.
PROMPTS = [
    [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120, 32, 106, 117],
    [72, 101, 108, 108, 111, 44],
]


def build(arch: str):
    import transformers as tf
    cls = {"mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
           "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM), "bamboo": (tf.MistralConfig, tf.MistralForCausalLM),
           "falcon": (tf.FalconConfig, tf.FalconForCausalLM), "falcon40b": (tf.FalconConfig, tf.FalconForCausalLM),
           "relufalcon": (tf.FalconConfig, tf.FalconForCausalLM),
           "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
           "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
           "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
           "qwen2moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
           "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
           "gpt-oss": (tf.GptOssConfig, tf.GptOssForCausalLM)}[arch]
    cfg = cls[0](**hf_config(arch))
    cfg._attn_implementation = "eager"
    if arch in OAI:  # its experts' own loop (GptOssExperts.forward), not a grouped kernel
        cfg._experts_implementation = "eager"
    model = cls[1](cfg).float().eval()
    sd = {k: torch.from_numpy(v) for k, v in hf_weights(arch).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert not missing and not unexpected, (arch, missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if arch in POWERINFER:
        _powerinfer_ffn(arch, model)
    if arch in MOE + OAI:
        _watch_routing(model)
    return model


class _Routing:
    """The smallest gap met between the k-th and the (k+1)-th router probability: routing is
    discontinuous, so a reference is only as good as this margin (the engine's float order
    differs from transformers' by about 1e-6)."""
    min_gap: float = float("inf")
    min_logit_gap: float = float("inf")  # the same in the router's logits, which the order follows


def _watch_routing(model) -> None:
    for layer in model.model.layers:
        def hook(mod, args, out):
            logits = out[0].float().sort(dim=-1, descending=True).values
            probs = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True).values
            k = mod.top_k
            _Routing.min_gap = min(_Routing.min_gap, float((probs[:, k - 1] - probs[:, k]).min()))
            _Routing.min_logit_gap = min(_Routing.min_logit_gap, float((logits[:, k - 1] - logits[:, k]).min()))
        (layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate).register_forward_hook(hook)


class _Predicted:
    """The predictor masks of the "predicted" run: off (dense) unless `start` is set."""
    start: int | None = None
    min_score: float = float("inf")


def _powerinfer_ffn(arch: str, model) -> None:
    """bamboo's symmetric ReLU FFN; both: the predictor's mask from position `_Predicted.start` on."""
    fc = {k: torch.from_numpy(v) for k, v in gguf_tensors(arch).items() if ".fc" in k}
    layers = model.transformer.h if arch == "relufalcon" else model.model.layers
    for i, layer in enumerate(layers):
        state = {}

        def grab(_mod, args, kwargs, state=state):
            state["h"] = args[0] if args else kwargs["hidden_states"]

        if arch == "relufalcon":  # PowerInfer's falcon: the predictor reads the layer's input
            layer.register_forward_pre_hook(grab, with_kwargs=True)
        else:  # llama/bamboo: the residual before the FFN's norm
            layer.post_attention_layernorm.register_forward_pre_hook(grab, with_kwargs=True)
        mlp = layer.mlp

        def mask(state=state, i=i):
            if _Predicted.start is None:
                return None
            h = state["h"][0]
            s = torch.relu(h @ fc[f"blk.{i}.fc1.weight"].T) @ fc[f"blk.{i}.fc2.weight"].T
            m = (s > 0).float()
            m[: _Predicted.start] = 1.0  # the prompt: dense prefill
            if s.shape[0] > _Predicted.start:
                _Predicted.min_score = min(_Predicted.min_score, float(s[_Predicted.start:].abs().min()))
            return m

        if arch == "relufalcon":
            def fwd(x, mlp=mlp, mask=mask):
                a = mlp.act(mlp.dense_h_to_4h(x))
                m = mask()
                return mlp.dense_4h_to_h(a if m is None else a * m)
        else:
            def fwd(x, mlp=mlp, mask=mask):
                a = mlp.act_fn(mlp.gate_proj(x)) * mlp.act_fn(mlp.up_proj(x))  # LLM_FFN_SYM
                m = mask()
                return mlp.down_proj(a if m is None else a * m)
        mlp.forward = fwd


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, margins = list(ids), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        seq.append(int(torch.argmax(logits)))
    return seq[len(ids):], margins


# Architectures transformers' own GGUF loader reads: our writer's file is read back through it and
# every tensor compared with the weights it was written from (the writer's names, permutations and
# layouts proven by an implementation that is not ours). Its config mapping reads no expert FFN
# length (expert_feed_forward_length), so the experts' sizes are given to it.
READBACK = ("qwen2moe", "qwen3moe")


def gguf_readback(arch: str) -> dict:
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tests.fixtures.tiny_arch import N_FF_EXPERT, write_tiny_arch

    sizes = dict(moe_intermediate_size=N_FF_EXPERT)
    if arch == "qwen2moe":
        sizes["shared_expert_intermediate_size"] = 2 * N_FF_EXPERT
    with tempfile.TemporaryDirectory() as d:
        write_tiny_arch(Path(d) / "m.gguf", arch)
        # ignore_mismatched_sizes: its loader shapes qwen2moe's 1-D shared expert gate (llama.cpp's
        # {n_embd}) as (1, 1, n); the tensor's values are compared below whatever its shape
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", torch_dtype=torch.float32,
                                                     ignore_mismatched_sizes=True, **sizes)
        read = load_gguf_checkpoint(str(Path(d) / "m.gguf"), return_tensors=True, model_to_load=model)["tensors"]
    want = hf_weights(arch)
    diffs = [float(np.abs(np.asarray(read[k], np.float32).reshape(-1) - np.asarray(v, np.float32).reshape(-1)).max())
             if k in read and np.asarray(read[k]).size == np.asarray(v).size else float("inf") for k, v in want.items()]
    return {"tensors": len(want), "read": len(read), "max_abs_diff": max(diffs)}


def main(only: list[str]) -> None:
    """Every architecture, or (`only`) those named, their entries merged into the committed files."""
    import transformers
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "n_new": N_NEW, "archs": {}}
    arrays = {}
    if only:
        out = json.loads((FIXTURES / "arch_reference.json").read_text())
        out.setdefault("versions", {}).update({a: {"transformers": transformers.__version__,
                                                   "torch": torch.__version__} for a in only})
        arrays = dict(np.load(FIXTURES / "arch_reference_logits.npz"))
    for arch in only or ARCHS + POWERINFER + MOE + OAI:
        model = build(arch)
        cases = []
        for k, p in enumerate(PROMPTS):
            _Routing.min_gap = _Routing.min_logit_gap = float("inf")
            ids, margins = greedy(model, p, N_NEW)
            cases.append({"prompt_ids": p, "generated_ids": ids, "min_margin": min(margins)})
            if arch in MOE + OAI:
                cases[-1]["min_route_gap"] = _Routing.min_gap
                cases[-1]["min_route_logit_gap"] = _Routing.min_logit_gap
            if k == 0:
                with torch.inference_mode():
                    arrays[arch] = model(input_ids=torch.tensor([p + ids]), use_cache=False).logits[0].float().numpy()
        out["archs"][arch] = cases
        print(arch, [c["generated_ids"] for c in cases], "min margin", min(c["min_margin"] for c in cases))
        if arch in READBACK:
            out.setdefault("gguf_readback", {})[arch] = gguf_readback(arch)
            print(arch, "read back by transformers' GGUF loader:", out["gguf_readback"][arch])
        if arch not in POWERINFER:
            continue
        cases = []
        for k, p in enumerate(PROMPTS):
            _Predicted.start, _Predicted.min_score = len(p), float("inf")
            ids, margins = greedy(model, p, N_NEW)
            cases.append({"prompt_ids": p, "generated_ids": ids, "min_margin": min(margins),
                          "min_abs_score": _Predicted.min_score})
            if k == 0:
                with torch.inference_mode():
                    arrays[arch + ".predicted"] = model(input_ids=torch.tensor([p + ids]),
                                                        use_cache=False).logits[0, len(p) - 1:].float().numpy()
            _Predicted.start = None
        out["archs"][arch + ".predicted"] = cases
        print(arch, "predicted", [c["generated_ids"] for c in cases], "min margin",
              min(c["min_margin"] for c in cases), "min |score|", min(c["min_abs_score"] for c in cases))
    (FIXTURES / "arch_reference.json").write_text(json.dumps(out, indent=1) + "\n")
    np.savez_compressed(FIXTURES / "arch_reference_logits.npz", **arrays)


if __name__ == "__main__":
    main(sys.argv[1:])  # architectures to (re)make alone, e.g. granite; none: all
