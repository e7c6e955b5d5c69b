"""Tests for mpgpt/data.py: tokenizer, the embedded source and its entropy rate, files, downloads, batches."""
import collections
import hashlib
import http.server
import math
import os
import threading
import time

import numpy as np
import pytest
import torch

from mpgpt import data
from mpgpt.data import (
    CharTokenizer,
    TextDataset,
    corpus_cross_entropy,
    corpus_entropy_rate,
    default_corpus,
    download_tiny_shakespeare,
    generate_corpus,
    load_text,
)


def fresh_seed():
    # Derived from torch's RNG, which conftest seeds from the OS for every test.
    return int(torch.randint(0, 2**31 - 1, ()).item())


# --------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip():
    text = "Hello, wörld!\nÅ ✓"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == "".join(sorted(set(text)))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.encode("") == []


def test_tokenizer_errors_name_the_problem():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"character 'z' at position 2 is not in the tokenizer's alphabet"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="cannot decode id 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="cannot decode id -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="unique"):
        CharTokenizer("abca")


# --------------------------------------------------------------------------- embedded corpus


def test_generate_corpus_is_deterministic_per_seed():
    seed = fresh_seed()
    a = generate_corpus(5000, seed=seed)
    assert len(a) == 5000
    assert a == generate_corpus(5000, seed=seed)
    assert a != generate_corpus(5000, seed=seed + 1)
    assert a[0].isupper()  # the text starts a sentence
    assert set(a) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,\n")
    assert generate_corpus(0) == ""


def test_default_corpus_is_cached_and_seed_zero():
    text = default_corpus()
    assert len(text) == 1_000_000
    assert default_corpus() is text  # cached in memory
    assert text[:20_000] == generate_corpus(20_000, seed=0)[:20_000]
    assert text.count(". ") + text.count(".\n") > 1000 and text.count("\n") > 100


def test_true_source_attains_the_entropy_rate():
    # The per-character log-loss of the true source on its own sample converges to the entropy
    # rate (Shannon-McMillan-Breiman). ~60k words: the sample mean's standard error is ~0.2%,
    # so 2% catches a wrong stationary distribution, a wrong character count, or a parser that
    # scores the wrong states.
    sample = generate_corpus(300_000, seed=fresh_seed())
    rate = corpus_entropy_rate()
    assert corpus_cross_entropy(sample) == pytest.approx(rate, rel=0.02)


def test_entropy_rate_is_a_useful_floor():
    # Well below what a model gets from character frequencies alone, so training has room to
    # show, but above zero: the text is not predictable outright.
    text = default_corpus()
    n = len(text)
    unigram = -sum(c / n * math.log(c / n) for c in collections.Counter(text).values())
    rate = corpus_entropy_rate()
    assert 0.5 < rate < 1.5
    assert unigram - rate > 1.5


def test_entropy_rate_matches_a_direct_count():
    # Independent of corpus_cross_entropy: estimate H(next | current) from word-pair counts of a
    # sample (plug-in estimator) and the characters per state from the text length.
    src = data._source()
    sample = generate_corpus(400_000, seed=fresh_seed())
    # Parse with a plain tokenizer: words, ". ", ".\n" and "," (each punctuation mark is a state).
    import re

    tokens = re.findall(r"[A-Za-z]+|\.\n|\. |,", sample)[:-1]
    ids = [src.punct_id[t] if t in src.punct_id else src.word_id[t.lower()] for t in tokens]
    pairs = collections.Counter(zip(ids[:-1], ids[1:]))
    firsts = collections.Counter(ids[:-1])
    n_pairs = len(ids) - 1
    h = -sum(c / n_pairs * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    chars_per_state = len(sample) / len(ids)
    # The plug-in estimator is biased low by about (#pairs seen) / (2 n); a few percent here.
    assert h / chars_per_state == pytest.approx(corpus_entropy_rate(), rel=0.05)
    # And the stationary distribution really is stationary.
    pi = src.stationary()
    np.testing.assert_allclose(pi @ src.P, pi, atol=1e-12)
    assert pi.min() > 0 and abs(pi.sum() - 1) < 1e-12


def test_cross_entropy_rejects_foreign_text():
    with pytest.raises(ValueError, match="not in the corpus source's vocabulary"):
        corpus_cross_entropy("The cat saw a zebra in the town. ")
    with pytest.raises(ValueError, match="was not produced by the corpus source"):
        corpus_cross_entropy("The cat;; saw the dog. ")


# ------------------------------------------------------------------------------------- files


def test_load_text(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("héllo\nworld", encoding="utf-8")
    assert load_text(good) == "héllo\nworld"
    assert load_text(str(good)) == "héllo\nworld"

    with pytest.raises(FileNotFoundError, match="no such file: .*missing.txt"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_text(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_text(empty)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_text(latin)


# ---------------------------------------------------------------------------------- download


class _Server:
    """A file server on 127.0.0.1 (only) that counts the requests it answers."""

    def __init__(self, files):
        self.files = files
        self.requests = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests += 1
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep test output clean
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    body = ("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50).encode()
    s = _Server({"/input.txt": body})
    s.body = body
    s.sha = hashlib.sha256(body).hexdigest()
    yield s
    s.close()


def test_download_verifies_and_caches(server, tmp_path):
    path = download_tiny_shakespeare(cache_dir=tmp_path, url=server.url("/input.txt"), sha256=server.sha)
    assert path.read_bytes() == server.body and server.requests == 1
    # A cache hit re-verifies the file but does not touch the network.
    again = download_tiny_shakespeare(cache_dir=tmp_path, url=server.url("/input.txt"), sha256=server.sha)
    assert again == path and server.requests == 1
    # A corrupted cache entry is noticed and replaced.
    path.write_bytes(b"truncated")
    fixed = download_tiny_shakespeare(cache_dir=tmp_path, url=server.url("/input.txt"), sha256=server.sha)
    assert fixed.read_bytes() == server.body and server.requests == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_download_checksum_mismatch_keeps_nothing(server, tmp_path):
    wrong = "0" * 64
    with pytest.raises(RuntimeError, match=f"checksum mismatch.*expected sha256 {wrong}, got {server.sha}"):
        download_tiny_shakespeare(cache_dir=tmp_path, url=server.url("/input.txt"), sha256=wrong)
    assert list(tmp_path.iterdir()) == []


def test_download_http_error_is_clear(server, tmp_path):
    with pytest.raises(RuntimeError, match="HTTP 404 Not Found; check the URL"):
        download_tiny_shakespeare(cache_dir=tmp_path, url=server.url("/nope.txt"), sha256=None)
    assert list(tmp_path.iterdir()) == []


def test_download_offline_is_clear(tmp_path):
    # A port nobody listens on: connection refused, as when offline.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="are you offline"):
        download_tiny_shakespeare(cache_dir=tmp_path, url=f"http://127.0.0.1:{port}/x.txt", timeout=5)


def test_tiny_shakespeare_constants():
    assert data.TINY_SHAKESPEARE_URL.endswith("/tinyshakespeare/input.txt")
    assert len(data.TINY_SHAKESPEARE_SHA256) == 64
    int(data.TINY_SHAKESPEARE_SHA256, 16)  # hex


# ----------------------------------------------------------------------------------- batches


def _counting_text(n):
    # Every character distinct and sorted, so token id == position: batches show where they came from.
    return "".join(chr(0x100 + i) for i in range(n))


def test_split_by_position():
    text = generate_corpus(10_000, seed=fresh_seed())
    ds = TextDataset(text, val_fraction=0.1)
    ids = torch.tensor(ds.tokenizer.encode(text))
    assert len(ds.train) == 9_000 and len(ds.val) == 1_000
    assert torch.equal(torch.cat([ds.train, ds.val]), ids)
    assert ds.train.dtype == torch.int64 and ds.vocab_size == len(set(text))


def test_get_batch_windows_and_targets():
    ds = TextDataset(_counting_text(1000), val_fraction=0.2)
    for split, lo, hi in (("train", 0, 800), ("val", 800, 1000)):
        x, y = ds.get_batch(split, batch_size=64, block_size=16)
        assert x.shape == y.shape == (64, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # targets are the next token
        assert torch.equal(x, x[:, :1] + torch.arange(16))  # contiguous windows
        assert x.min() >= lo and y.max() < hi  # never crossing into the other split


def test_get_batch_is_reproducible_with_a_generator():
    ds = TextDataset(_counting_text(5000))
    a = ds.get_batch("train", 8, 32, generator=torch.Generator().manual_seed(7))
    b = ds.get_batch("train", 8, 32, generator=torch.Generator().manual_seed(7))
    c = ds.get_batch("train", 8, 32, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_get_batch_errors():
    ds = TextDataset(_counting_text(100), val_fraction=0.1)
    with pytest.raises(ValueError, match=r"block_size 10 needs at least 11 tokens in the 'val' split, which has 10"):
        ds.get_batch("val", 4, 10)
    ds.get_batch("val", 4, 9)  # the largest block that fits
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        ds.get_batch("test", 4, 8)
    with pytest.raises(ValueError, match="val_fraction"):
        TextDataset("abc", val_fraction=1.0)


class _OddServer(_Server):
    """Serves one path badly: a body shorter than its Content-Length, or slowly, one byte at a time."""

    def __init__(self, body, *, announce=None, drip_s=0.0):
        super().__init__({})
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(announce if announce is not None else len(body)))
                self.end_headers()
                for i in range(0, len(body), 64 if drip_s else len(body)):
                    self.wfile.write(body[i:i + (64 if drip_s else len(body))])
                    self.wfile.flush()
                    time.sleep(drip_s)

            def log_message(self, *args):
                pass

        self.httpd.RequestHandlerClass = Handler


def test_download_refuses_a_response_over_the_size_cap(server, tmp_path):
    with pytest.raises(RuntimeError, match="the response is over 1000 bytes"):
        download_tiny_shakespeare(cache_dir=tmp_path, url=server.url("/input.txt"), sha256=None, max_bytes=1000)
    assert list(tmp_path.iterdir()) == []


def test_download_refuses_a_truncated_response_even_without_a_checksum(tmp_path):
    s = _OddServer(b"First Citizen:\n" * 20, announce=10_000)  # promises more than it sends, then hangs up
    try:
        with pytest.raises(RuntimeError, match=r"got 300 of 10000 bytes .* retry"):
            download_tiny_shakespeare(cache_dir=tmp_path, url=s.url("/input.txt"), sha256=None, timeout=5)
    finally:
        s.close()
    assert list(tmp_path.iterdir()) == []


def test_download_timeout_bounds_the_whole_download(tmp_path):
    # Every read arrives well within the timeout, but the whole takes 20 x 0.1 s = 2 s > 0.5 s.
    s = _OddServer(b"x" * 64 * 20, drip_s=0.1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="not finished after 0.5 s"):
            download_tiny_shakespeare(cache_dir=tmp_path, url=s.url("/input.txt"), sha256=None, timeout=0.5)
        assert time.monotonic() - t0 < 1.8
    finally:
        s.close()
    assert list(tmp_path.iterdir()) == []


def test_load_text_refuses_nul_bytes_and_pipes(tmp_path):
    nul = tmp_path / "zeros.txt"
    nul.write_bytes(b"\x00" * 1000)
    with pytest.raises(ValueError, match="contains NUL bytes .* pass a UTF-8 text file"):
        load_text(nul)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_text(fifo)  # returns at once: nobody writes to the pipe, and we never open it
