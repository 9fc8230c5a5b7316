from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_models_load(tiny_llama_dir, tiny_opt_dir):
    for path in (tiny_llama_dir, tiny_opt_dir):
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("def f(x): return x", return_tensors="pt").input_ids
        assert model(ids).logits.shape[-1] == model.config.vocab_size
