import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from gemmaforge.train.linear_cross_entropy import fusable_output_layer
from gemmaforge.train.loss import supervised_loss
from gemmaforge.train.template_tokens import use_sparse_template_tokens


def peft_model(model_dir, seed: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"],
                        trainable_token_indices=[105, 106])
    peft = get_peft_model(model, config)
    with torch.no_grad():  # move the trained rows away from their base values, so corrections are non-zero
        for name, param in peft.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return peft


def test_sparse_forward_equals_peft_values_and_gradients(tiny_gemma3_dir) -> None:
    ids = torch.tensor([[2, 105, 2364, 107, 500, 106, 107, 105, 4368, 107, 600, 700, 106]])
    labels = ids.clone()
    labels[:, :9] = -100
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    results = []
    for ours in (False, True):  # PEFT's own forward and transformers' loss, then ours
        model = peft_model(tiny_gemma3_dir, seed=0)
        if ours:
            assert use_sparse_template_tokens(model) == 2  # input embedding and the tied output layer
            assert fusable_output_layer(model.get_base_model().get_output_embeddings()) is not None
        loss = supervised_loss(model, inputs, None) if ours else model(**inputs).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss_ref, grads_ref), (loss_ours, grads_ours) = results
    torch.testing.assert_close(loss_ours, loss_ref)
    assert grads_ours.keys() == grads_ref.keys() and any("trainable_tokens_delta" in n for n in grads_ours)
    for name in grads_ref:
        torch.testing.assert_close(grads_ours[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
