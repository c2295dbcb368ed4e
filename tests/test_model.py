import math

import pytest
import torch

from zerodp.models.gpt import GPT, SIZES, gpt_config


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", **overrides))


def test_lm_head_is_tied_to_token_embedding_as_one_parameter():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # listed once


def test_loss_at_init_is_close_to_uniform_over_vocab():
    model = tiny_gpt()
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    loss = model(x, y)
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1


def test_forward_without_targets_returns_logits():
    model = tiny_gpt()
    assert model(torch.zeros(3, 10, dtype=torch.long)).shape == (3, 10, 256)


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
    x2 = x.clone()
    x2[0, 20] = (x[0, 20] + 1) % 256
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_sequence_longer_than_block_size_is_an_error():
    with pytest.raises(ValueError, match="block_size"):
        tiny_gpt()(torch.zeros(1, 65, dtype=torch.long))


def test_residual_projections_use_scaled_init():
    model = GPT(gpt_config("small"))
    std = model.blocks[0].mlp.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * 6), rel=0.05)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize(
    "size,expected",
    [("125M", 125e6), ("350M", 350e6), ("760M", 760e6), ("1.3B", 1.3e9),
     ("2.7B", 2.7e9), ("6.7B", 6.7e9), ("13B", 13e9)],
)
def test_named_size_has_about_its_named_parameter_count(size, expected):
    with torch.device("meta"):
        model = GPT(gpt_config(size))
    assert abs(model.num_params() / expected - 1) < 0.03


def test_tiny_and_small_sizes_are_cpu_sized():
    assert GPT(gpt_config("tiny")).num_params() < 200_000
    assert 3e6 < GPT(gpt_config("small")).num_params() < 6e6


def test_non_embedding_count_leaves_out_the_position_table():
    model = tiny_gpt()
    assert model.num_params() - model.num_params(non_embedding=True) == 64 * 64


def test_flops_per_token_is_6n_plus_attention():
    model = tiny_gpt()
    assert model.flops_per_token(64) == 6 * model.num_params() + 12 * 2 * 64 * 64


def test_unknown_size_error_lists_valid_sizes():
    with pytest.raises(ValueError, match="125M") as err:
        gpt_config("huge")
    assert "'huge'" in str(err.value) and all(size in str(err.value) for size in SIZES)


def test_overrides_replace_size_fields():
    config = gpt_config("125M", block_size=2048, dropout=0.1)
    assert (config.block_size, config.dropout, config.n_layer) == (2048, 0.1, 12)


def test_meta_model_materialised_with_to_empty_and_init_weights_trains():
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()  # to_empty() unties the head; init_weights() ties it again
    assert model.lm_head.weight is model.wte.weight
    loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    loss.backward()
    assert torch.isfinite(loss) and model.wte.weight.grad is not None


def test_bf16_model_runs_forward_and_backward():
    model = tiny_gpt().to(torch.bfloat16)
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    loss = model(x, x)
    assert loss.dtype == torch.float32  # the cross-entropy runs in fp32
    loss.backward()
    assert model.wte.weight.grad.dtype == torch.bfloat16


def test_generate_appends_tokens():
    out = tiny_gpt().eval().generate(torch.zeros(1, 3, dtype=torch.long), 5, top_k=10)
    assert out.shape == (1, 8) and out.max() < 256


def _saved_bytes(model, x, y):
    """Bytes autograd keeps for backward, and the loss."""
    sizes = {}

    def pack(t):
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    return sum(sizes.values()), loss


def test_loss_in_chunks_matches_and_keeps_no_whole_logits():
    torch.manual_seed(0)
    whole = GPT(gpt_config("tiny"))
    chunked = GPT(gpt_config("tiny", loss_chunk=40))  # 3 x 64 tokens: pieces of 40, the last of 32
    chunked.load_state_dict(whole.state_dict())
    x = torch.randint(0, 256, (3, 64))
    y = x.roll(-1, dims=1)
    y[0, :7] = -1  # ignored targets count in neither the sum nor the mean
    saved_whole, loss_whole = _saved_bytes(whole, x, y)
    saved_chunked, loss_chunked = _saved_bytes(chunked, x, y)
    torch.testing.assert_close(loss_chunked, loss_whole, rtol=1e-6, atol=0)
    loss_whole.backward()
    loss_chunked.backward()
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    logits_fp32 = 3 * 64 * 256 * 4
    assert saved_whole - saved_chunked > logits_fp32, (saved_whole, saved_chunked)
