import numpy as np
import pytest
import torch

from zerodp.train.data import Batches, decode, encode, load_corpus, val_batches


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus(None, max_bytes=1 << 20)


def test_stdlib_corpus_is_nonempty_python_bytes(stdlib_corpus):
    c = stdlib_corpus
    assert c.vocab_size == 256 and c.train.dtype == np.uint8
    assert len(c.train) + len(c.val) == 1 << 20  # capped at max_bytes exactly
    assert b"def " in c.train[:100_000].tobytes()


def test_stdlib_corpus_is_deterministic(stdlib_corpus):
    again = load_corpus(None, max_bytes=1 << 20)
    assert np.array_equal(again.train, stdlib_corpus.train)
    assert np.array_equal(again.val, stdlib_corpus.val)


def test_validation_split_is_the_last_five_percent(stdlib_corpus):
    n = len(stdlib_corpus.train) + len(stdlib_corpus.val)
    assert len(stdlib_corpus.val) == int(n * 0.05)


def test_y_is_x_shifted_by_one():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = Batches(tokens, block_size=16, micro_batch_size=4).next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, 0], x[:, 0] + 1)


def global_batch(tokens, world_size, micro, step, seed=7):
    """The global batch at `step`, stitched together from every rank's rows."""
    ranks = [Batches(tokens, 8, micro, rank, world_size, seed) for rank in range(world_size)]
    rows = [batches.batch(step) for batches in ranks]
    return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])


def test_global_batch_is_the_same_for_any_world_size_at_fixed_global_batch_size():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    for step in range(3):
        x1, y1 = global_batch(tokens, world_size=1, micro=4, step=step)
        for world_size, micro in [(2, 2), (4, 1)]:
            x, y = global_batch(tokens, world_size, micro, step)
            assert torch.equal(x, x1) and torch.equal(y, y1)


def test_ranks_read_different_rows():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    xs = [Batches(tokens, 8, 2, rank, 4, seed=7).batch(0)[0] for rank in range(4)]
    assert all(not torch.equal(xs[i], xs[j]) for i in range(4) for j in range(i + 1, 4))


def test_steps_and_seeds_give_different_batches():
    tokens = np.arange(100_000) % 256
    b = Batches(tokens, 8, 4, seed=1)
    assert not torch.equal(b.next_batch()[0], b.next_batch()[0])
    other_seed = Batches(tokens, 8, 4, seed=2)
    assert not torch.equal(other_seed.batch(0)[0], Batches(tokens, 8, 4, seed=1).batch(0)[0])


def test_state_dict_resume_reproduces_the_next_batch():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    run = Batches(tokens, 8, 2, rank=1, world_size=2, seed=5)
    for _ in range(3):
        next(run)
    state = run.state_dict()
    assert state == {"step": 3, "seed": 5}
    expected = run.next_batch()
    resumed = Batches(tokens, 8, 2, rank=1, world_size=2, seed=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), expected))


def test_val_batches_are_fixed_and_world_size_independent():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    one = val_batches(tokens, 8, 4, n=3)
    again = val_batches(tokens, 8, 4, n=3)
    assert len(one) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(one, again))
    halves = [val_batches(tokens, 8, 2, n=3, rank=r, world_size=2) for r in range(2)]
    for k in range(3):
        assert torch.equal(torch.cat([halves[0][k][0], halves[1][k][0]]), one[k][0])


def test_bin_token_file_is_memory_mapped_with_its_vocab(tmp_path):
    tokens = (np.arange(3000) * 7 % 50000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    c = load_corpus(str(tmp_path / "train.bin"))
    assert c.vocab_size == int(tokens.max()) + 1 and c.train.dtype == np.uint16
    assert np.array_equal(np.concatenate([c.train, c.val]), tokens) and len(c.val) == 150
    x, y = Batches(c.train, 32, 2).next_batch()
    assert x.max() > 255 and torch.equal(y[:, :-1], x[:, 1:])


def test_bin_validation_comes_from_sibling_val_bin(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.full(200, 60000, dtype=np.uint16).tofile(tmp_path / "val.bin")
    c = load_corpus(str(tmp_path / "train.bin"))
    assert len(c.train) == 1000 and len(c.val) == 200 and c.vocab_size == 60001


def test_text_directory_loads_its_text_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second file " * 100)
    (tmp_path / "a.txt").write_text("first file " * 100)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0\0\0binary")
    c = load_corpus(str(tmp_path))
    text = decode(np.concatenate([c.train, c.val]))
    assert text.index("first") < text.index("second") and "PNG" not in text


def test_single_text_file_loads_and_is_capped(tmp_path):
    (tmp_path / "notes.md").write_text("hello world\n" * 1000)
    c = load_corpus(str(tmp_path / "notes.md"), max_bytes=5000)
    assert len(c.train) + len(c.val) == 5000


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(tmp_path))


def test_corpus_shorter_than_a_block_is_an_error():
    with pytest.raises(ValueError, match="block_size"):
        Batches(np.zeros(64, dtype=np.uint8), block_size=64, micro_batch_size=1)


def test_bad_rank_is_an_error():
    with pytest.raises(ValueError, match="rank"):
        Batches(np.zeros(100, dtype=np.uint8), 8, 1, rank=2, world_size=2)


def test_encode_decode_round_trip_and_replace_invalid_bytes():
    assert decode(encode("héllo")) == "héllo"
    assert decode([104, 255, 105]) == "h\ufffdi"
