"""Does vLLM (0.32, CPU build) apply a PEFT adapter's lm_head LoRA? A probe, not a test (docs/lora.md, "Sync to the
rollout engine"): a tiny seeded checkpoint with a tokenizer, a PEFT adapter on q_proj + lm_head (B non-zero) saved
as parallm's save_hf_adapter saves it (factors only), vLLM's log-probs of its own samples with the LoRARequest,
without it before and after, against transformers + PEFT.

    VLLM venv: python scripts/probe_vllm_head_lora.py qwen3 untied|tied [targets, comma-separated] [workdir]

Found with vLLM 0.32.0 (CPU): Qwen3 untied and tied: with the adapter within 2.2e-6 of PEFT; a request without a
LoRARequest after the adapter was loaded gets the base plus the head's delta (within 2.9e-6 of that, 4.8-5.1 off
the base); with q_proj alone the base stays exact. Qwen2: the adapter is refused ("expected target modules in
{...} but received ['lm_head', ...]") and the engine core dies.
"""
import copy, os, sys, tempfile, warnings
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
import torch, peft
import vllm_engines as ve
TARGETS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["q_proj", "lm_head"]

def main():
    family, tied = sys.argv[1], sys.argv[2] == "tied"
    work = sys.argv[4] if len(sys.argv) > 4 else tempfile.mkdtemp(prefix="probe-head-lora-")
    root = os.path.join(work, f"{family}_{sys.argv[2]}_{len(TARGETS)}")
    ckpt = ve.checkpoint(root + "_ckpt", family, 0, tie_word_embeddings=tied)
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = root + "_adapter"
    model.save_pretrained(adapter, save_embedding_layers=False)   # as parallm's save_hf_adapter: factors only
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    llm = LLM(model=ckpt, dtype="float32", max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0, enforce_eager=True,
              enable_lora=True, max_lora_rank=8, max_loras=1)
    prompts = ve.prompts(base.config.vocab_size, 1)
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=3, ignore_eos=True)
    def run(lora):
        try:
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, lora_request=lora)
        except Exception as e:
            return repr(e)[:600]
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in res]
    def ref_lp(m, samples):
        worst = 0.0
        for p, (toks, lps) in zip(prompts, samples):
            ids = torch.tensor([p + toks])
            with torch.no_grad():
                lp = m(input_ids=ids).logits[0].float().log_softmax(-1)
            mine = [lp[len(p) - 1 + k, t].item() for k, t in enumerate(toks)]
            worst = max(worst, max(abs(a - b) for a, b in zip(mine, lps)))
        return worst
    first = run(None)
    print(family, sys.argv[2], "no LoRARequest, before any adapter, vs base: %.3g" % ref_lp(base, first))
    out = run(LoRARequest("head", 1, adapter))
    if isinstance(out, str):
        print(family, sys.argv[2], "ADAPTER REFUSED:", out)
    else:
        no_head = copy.deepcopy(model)
        with torch.no_grad():
            if "lm_head" in TARGETS:
                no_head.base_model.model.lm_head.lora_B["default"].weight.zero_()
        print(family, sys.argv[2], "vLLM vs PEFT (with head LoRA): %.3g | vs PEFT without the head's delta: %.3g | "
              "vs base: %.3g" % (ref_lp(model, out), ref_lp(no_head, out), ref_lp(base, out)))
    base_out = run(None)
    head_only = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in head_only.named_parameters():
            if "lora_B" in n and "lm_head" not in n:
                p.zero_()
    print(family, sys.argv[2], "no LoRARequest after the adapter ran, vs base + the head's delta only: %.3g"
          % ref_lp(head_only, base_out))
    print(family, sys.argv[2], "no LoRARequest after the adapter ran, vs base: %.3g, vs PEFT: %.3g, vs PEFT "
          "w/o head delta: %.3g" % (ref_lp(base, base_out), ref_lp(model, base_out),
                                    ref_lp(no_head, base_out) if not isinstance(out, str) else -1))

if __name__ == '__main__':
    main()
