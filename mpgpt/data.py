"""Text data for the GPT: a character tokenizer, an embedded corpus, loaders and batches.

Chapter 2 ("The fp32 GPT") explains this module.

The default corpus is generated here, with no network and no copyrighted text: English-like
sentences drawn from a small Markov source ("the quiet fox found a stone. They often
watched the bridge, and ...") whose entropy rate we can compute exactly. That number,
:func:`corpus_entropy_rate`, is the loss floor: no model, however large, can predict the
next character of this text better on average, so a training curve can be drawn against it.

Tiny Shakespeare (Karpathy's char-rnn corpus) is available through a cached, checksum-verified
downloader for machines that are online (Colab); :func:`load_text` reads any local file.

Typical use::

    text = default_corpus()                     # 1,000,000 characters, deterministic
    ds = TextDataset(text)                      # char tokenizer built from the text
    x, y = ds.get_batch("train", batch_size=32, block_size=64)   # (B, T) int64 each
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import os
import re
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "CharTokenizer",
    "generate_corpus",
    "corpus_entropy_rate",
    "corpus_cross_entropy",
    "default_corpus",
    "load_text",
    "download_tiny_shakespeare",
    "TextDataset",
    "TINY_SHAKESPEARE_URL",
    "TINY_SHAKESPEARE_SHA256",
    "TINY_SHAKESPEARE_NUM_BYTES",
]

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class CharTokenizer:
    """Maps each character of a fixed alphabet to an integer id (its position in `chars`)."""

    def __init__(self, chars: str):
        if not chars:
            raise ValueError("CharTokenizer needs at least one character; build it with from_text(text)")
        if len(set(chars)) != len(chars):
            dupes = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"CharTokenizer characters must be unique; repeated: {dupes!r}")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        # A lookup table indexed by code point makes encoding a megabyte a numpy gather.
        codes = np.array([ord(c) for c in chars], dtype=np.int64)
        self._lut = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
        self._lut[codes] = np.arange(len(chars))

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose alphabet is every character that occurs in `text`, sorted."""
        if not text:
            raise ValueError("cannot build a tokenizer from empty text")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self._encode_array(text).tolist()

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = list(ids)
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"cannot decode id {i!r}: ids must be ints in [0, {self.vocab_size})")
        return "".join(self.chars[i] for i in ids)

    def _encode_array(self, text: str) -> np.ndarray:
        """Encode to a 1-D int64 array; raises ValueError naming the first unknown character."""
        if not text:
            return np.zeros(0, dtype=np.int64)
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.full(codes.shape, -1, dtype=np.int64)
        known = codes < len(self._lut)
        ids[known] = self._lut[codes[known]]
        if (ids < 0).any():
            pos = int(np.argmax(ids < 0))
            raise ValueError(
                f"character {text[pos]!r} at position {pos} is not in the tokenizer's alphabet; "
                "build the tokenizer from text that contains it (CharTokenizer.from_text)"
            )
        return ids

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------
# The embedded corpus: a Markov source with a known entropy rate
# --------------------------------------------------------------------------------------------
# The source is a first-order Markov chain over *states*; every state is a word or a
# punctuation mark. A word's class (determiner, noun, ...) decides which classes may follow,
# and within the next class a word is drawn from fixed Zipf-like weights, so
#     P(next = w' | current = w) = G[class(w), class(w')] * p(w' | class(w')).
# Word lists of different classes are disjoint, so a word alone names its state, and the text
# can be parsed back into the state sequence (corpus_cross_entropy does exactly that). The
# whole source is fixed by the tables below: no random numbers go into building it.

_WORDS = {
    "DET": "the a this that every some no my our her his its one",
    "PRON": "he she we they it you",
    "NOUN": (
        "cat dog bird fish tree sun moon star rain wind sea road hill town king queen ship boat "
        "door house room wall book song word name day night year hand eye head heart mind fire "
        "stone gold bread milk tea cup box bag hat coat bed lamp key map pen car bus train field "
        "farm horse cow goat wolf bear fox owl river lake wood rock snow leaf seed root child man "
        "woman friend mother father girl boy cook judge clerk ghost crow bell clock game plan "
        "dream story garden window letter market village city island forest mountain valley "
        "bridge castle tower candle mirror apple onion"
    ),
    "VERB": (
        "saw found took gave made kept lost held told knew left met sold bought built broke drew "
        "wrote loved liked wanted needed carried opened closed followed watched called helped "
        "moved painted pulled pushed showed touched burned washed fixed counted cleaned stole "
        "chose hid fed caught taught brought sent heard missed visited reached passed"
    ),
    "ADJ": (
        "old new big small red blue green dark bright cold warm quiet loud happy sad strange "
        "quick slow tall short young wild soft hard heavy empty full clean rich poor proud tired "
        "gentle brave golden silver wooden broken hidden lonely little"
    ),
    "ADV": "slowly quickly often never always soon again later then still once twice gladly softly badly nearly rarely",
    "PREP": "in on by near under over with from into behind across beside without toward",
    "CONJ": "and but so while because until yet",
}
# Punctuation states and what each one writes. A word writes " word" after a word or a comma,
# and "Word" (capitalised, no space) at the start of a sentence.
_PUNCT = {"END": ". ", "END_NL": ".\n", "COMMA": ","}
_CLASSES = list(_WORDS) + list(_PUNCT)

# The grammar: G[class][next class]. Each row sums to 1. The start of the text behaves like
# the end of a sentence (row "END").
_SENTENCE_START = {"DET": 0.50, "PRON": 0.30, "ADV": 0.10, "NOUN": 0.10}
_GRAMMAR = {
    "DET": {"ADJ": 0.35, "NOUN": 0.65},
    "PRON": {"VERB": 0.80, "ADV": 0.20},
    "NOUN": {"VERB": 0.40, "PREP": 0.15, "END": 0.18, "END_NL": 0.04, "COMMA": 0.08, "CONJ": 0.07, "ADV": 0.08},
    "VERB": {"DET": 0.45, "PRON": 0.08, "PREP": 0.17, "ADV": 0.12, "END": 0.14, "END_NL": 0.04},
    "ADJ": {"ADJ": 0.12, "NOUN": 0.88},
    "ADV": {"VERB": 0.45, "PREP": 0.15, "DET": 0.15, "END": 0.20, "END_NL": 0.05},
    "PREP": {"DET": 0.80, "NOUN": 0.12, "PRON": 0.08},
    "CONJ": {"DET": 0.50, "PRON": 0.35, "NOUN": 0.15},
    "END": _SENTENCE_START,
    "END_NL": _SENTENCE_START,
    "COMMA": {"CONJ": 0.70, "DET": 0.20, "PRON": 0.10},
}
# Within a class the k-th listed word has weight 1 / (k + 2) ** _ZIPF_EXPONENT: a few common
# words, a long tail, as in real text.
_ZIPF_EXPONENT = 0.7


class _MarkovSource:
    """The fixed source: states, their emissions and the transition matrix (float64)."""

    def __init__(self):
        words = {c: s.split() for c, s in _WORDS.items()}
        all_words = [w for ws in words.values() for w in ws]
        assert len(all_words) == len(set(all_words)), "word classes must be disjoint"
        # State ids: words first (grouped by class), then punctuation.
        self.state_text = all_words + list(_PUNCT.values())
        self.state_class = [c for c, ws in words.items() for _ in ws] + list(_PUNCT)
        self.word_id = {w: i for i, w in enumerate(all_words)}
        self.punct_id = {text: len(all_words) + k for k, text in enumerate(_PUNCT.values())}
        self.is_word = np.array([c in _WORDS for c in self.state_class])
        self.starts_sentence = np.array([c in ("END", "END_NL") for c in self.state_class])
        n = len(self.state_text)

        # Members of each class and their within-class probabilities.
        self.members, self.member_probs = {}, {}
        for c in _CLASSES:
            ids = [i for i in range(n) if self.state_class[i] == c]
            w = 1.0 / (np.arange(len(ids)) + 2.0) ** _ZIPF_EXPONENT
            self.members[c] = np.array(ids)
            self.member_probs[c] = w / w.sum()

        # Full state-level transition matrix P[i, j] = G[class i, class j] * p(j | class j).
        self.P = np.zeros((n, n))
        for i in range(n):
            for c_next, g in _GRAMMAR[self.state_class[i]].items():
                self.P[i, self.members[c_next]] = g * self.member_probs[c_next]
        assert np.allclose(self.P.sum(1), 1.0)

        # Characters written when entering state j from state i (see _PUNCT's comment).
        lens = np.array([len(t) for t in self.state_text], dtype=np.float64)
        self.emit_len = np.tile(np.where(self.is_word, lens + 1, lens), (n, 1))  # (n, n)
        self.emit_len[np.ix_(self.starts_sentence, self.is_word)] -= 1  # "Word", no space

        # Samplers: class -> cumulative distribution over next classes / over member words.
        self._class_list = _CLASSES
        self._class_cdf = [_cdf([_GRAMMAR[c].get(d, 0.0) for d in _CLASSES]).tolist() for c in _CLASSES]
        self._cap = [t[:1].upper() + t[1:] if w else t for t, w in zip(self.state_text, self.is_word)]
        self._spaced = [" " + t if w else t for t, w in zip(self.state_text, self.is_word)]

    def stationary(self) -> np.ndarray:
        """The stationary distribution pi (pi P = pi, sum 1), by a direct linear solve."""
        n = len(self.P)
        A = self.P.T - np.eye(n)
        A[-1, :] = 1.0  # replace one (redundant) balance equation by the normalisation
        b = np.zeros(n)
        b[-1] = 1.0
        return np.linalg.solve(A, b)

    def entropy_rate(self) -> float:
        """Nats per character: H(next state | state) / characters per state (renewal-reward)."""
        pi = self.stationary()
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(self.P > 0, self.P * np.log(self.P), 0.0)
        nats_per_state = -(pi * plogp.sum(1)).sum()
        chars_per_state = (pi * (self.P * self.emit_len).sum(1)).sum()
        return float(nats_per_state / chars_per_state)

    def sample(self, n_chars: int, seed: int) -> str:
        rng = np.random.default_rng(seed)
        class_ix = {c: k for k, c in enumerate(self._class_list)}
        pieces, total = [], 0
        cls = class_ix["END"]  # the text starts like a new sentence
        prev_starts = True
        while total < n_chars:
            # A chunk of states: walk the class chain (cheap: 11 classes), then draw every word of
            # each class at once with searchsorted on its cumulative weights. The chunk size is
            # fixed so that a shorter text is a prefix of a longer one with the same seed.
            n_states = 1 << 14
            u = rng.random(n_states).tolist()
            classes = np.empty(n_states, dtype=np.int64)
            for t in range(n_states):
                cls = bisect.bisect_right(self._class_cdf[cls], u[t])  # first class with cdf > u
                classes[t] = cls
            v = rng.random(n_states)
            states = np.empty(n_states, dtype=np.int64)
            for k, c in enumerate(self._class_list):
                at = classes == k
                pick = np.searchsorted(_cdf(self.member_probs[c]), v[at], side="right")
                states[at] = self.members[c][pick]
            # Emit: capitalise a word that starts a sentence, otherwise put a space before it.
            after_end = np.empty(n_states, dtype=bool)
            after_end[0] = prev_starts
            after_end[1:] = self.starts_sentence[states[:-1]]
            prev_starts = bool(self.starts_sentence[states[-1]])
            chunk = "".join(
                self._cap[s] if a else self._spaced[s] for s, a in zip(states.tolist(), after_end.tolist())
            )
            pieces.append(chunk)
            total += len(chunk)
        return "".join(pieces)[:n_chars]


def _cdf(probs) -> np.ndarray:
    """Cumulative distribution whose last entry is exactly 1.0, so a uniform u in [0, 1) always
    lands on an outcome of positive probability (searchsorted / bisect_right: first cdf > u)."""
    c = np.cumsum(probs, dtype=np.float64)
    return c / c[-1]


@functools.lru_cache(maxsize=1)
def _source() -> _MarkovSource:
    return _MarkovSource()


def generate_corpus(n_chars: int, seed: int = 0) -> str:
    """`n_chars` characters of English-like text from the embedded Markov source.

    Deterministic for a given seed (numpy's PCG64 generator). The text may end mid-word.
    """
    if not isinstance(n_chars, int) or n_chars < 0:
        raise ValueError(f"n_chars must be a non-negative int, got {n_chars!r}")
    if n_chars == 0:
        return ""
    return _source().sample(n_chars, seed)


def corpus_entropy_rate() -> float:
    """The entropy rate of the embedded source, in nats per character: the loss floor.

    The text is a one-to-one, left-to-right decodable spelling of a Markov chain over words and
    punctuation, so its information per character is the chain's entropy rate
    H = -sum_i pi_i sum_j P_ij ln P_ij (nats per state) divided by the mean number of
    characters written per state, sum_i pi_i sum_j P_ij len_ij (a renewal-reward argument:
    over a long text both grow in proportion to the number of states). pi is the stationary
    distribution, computed exactly in float64.
    """
    return _source().entropy_rate()


def corpus_cross_entropy(text: str) -> float:
    """Mean nats per character of `text` under the true source (the best possible model).

    Parses `text` back into the source's states and scores every transition. The last token is
    dropped (it may be cut off), and the first is scored as a sentence start. On a long sample
    this approaches :func:`corpus_entropy_rate`; on a model's validation split it is the
    number to compare the model's loss with.
    """
    src = _source()
    ids, pos = [], 0
    for m in re.finditer(r" ?[A-Za-z]+|\.\n|\. |,", text):
        if m.start() != pos:
            raise ValueError(f"text at position {pos} ({text[pos:pos + 10]!r}) was not produced by the corpus source")
        tok = m.group()
        if tok[0] in ".,":
            ids.append(src.punct_id[tok])
        else:
            word = tok.strip().lower()
            if word not in src.word_id:
                # Only the last token may be an unknown fragment (the text can end mid-word).
                if m.end() == len(text):
                    break
                raise ValueError(f"word {word!r} at position {m.start()} is not in the corpus source's vocabulary")
            ids.append(src.word_id[word])
        pos = m.end()
    ids = ids[:-1]  # the last token may be cut off
    if not ids:
        raise ValueError("text too short: it needs at least two complete words")
    states = np.array(ids)
    start = src.punct_id[". "]  # the first word is scored as a sentence start
    prev = np.concatenate([[start], states[:-1]])
    nll = -np.log(src.P[prev, states]).sum()
    n_chars = src.emit_len[prev, states].sum()
    return float(nll / n_chars)


@functools.lru_cache(maxsize=1)
def default_corpus() -> str:
    """The course's default training text: 1,000,000 characters of the embedded source, seed 0."""
    return generate_corpus(1_000_000, seed=0)


# --------------------------------------------------------------------------------------------
# Files and downloads
# --------------------------------------------------------------------------------------------


def load_text(path) -> str:
    """Read a UTF-8 text file, with a one-line error saying what is wrong and what to do."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}; check the path (relative paths start at {Path.cwd()})")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; pass the path of a text file inside it")
    if not path.is_file():  # a FIFO or a device: reading it might never end
        raise ValueError(f"{path} is not a regular file (a pipe or device); save the text to a file and pass that")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path} is empty; a language model needs some text to learn from")
    if b"\x00" in data:  # valid UTF-8, but no text has NUL bytes: a binary file (all NULs trains to loss 0)
        raise ValueError(f"{path} contains NUL bytes (offset {data.index(0)}), so it is binary, not text; "
                         "pass a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it first, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`"
        ) from None


TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# SHA-256 of the 1,115,394-byte file, as pinned by independent projects that download it
# (e.g. LuxDL/Lux.jl examples/NanoGPT/main.jl registers this URL with this hash).
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_NUM_BYTES = 1_115_394


class _TooLarge(Exception):
    """Internal: the response passed ``max_bytes`` (its size so far is the argument)."""


def _default_cache_dir() -> Path:
    return Path(os.environ.get("MPGPT_CACHE", Path.home() / ".cache" / "mpgpt"))


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_tiny_shakespeare(
    cache_dir=None,
    url: str = TINY_SHAKESPEARE_URL,
    sha256: str | None = TINY_SHAKESPEARE_SHA256,
    timeout: float = 30.0,
    max_bytes: int = 4 * TINY_SHAKESPEARE_NUM_BYTES,
) -> Path:
    """Download Tiny Shakespeare once, verify its SHA-256, and return the cached file's path.

    The cache (default ``$MPGPT_CACHE`` or ``~/.cache/mpgpt``) is checked first: a cached file
    that still matches `sha256` is returned without touching the network; one that does not is
    replaced. A download goes to a temporary file beside the target and is moved into place
    with ``os.replace`` only after it verifies, so an interrupted or corrupt download never
    leaves a bad file behind. ``sha256=None`` skips the checksum, not the length check: a response
    shorter than its ``Content-Length`` is refused either way. ``timeout`` bounds the whole download
    (not each read), and a response over ``max_bytes`` (announced or received) is refused as soon as
    that is known, without reading the rest.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / "tiny_shakespeare.txt"
    if target.is_file() and (sha256 is None or _sha256_of(target) == sha256.lower()):
        return target

    fd, tmp_name = tempfile.mkstemp(dir=cache_dir, prefix=".tiny_shakespeare.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        deadline = time.monotonic() + timeout
        received, announced = 0, None
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
                length = response.headers.get("Content-Length")
                announced = int(length) if length and length.isdigit() else None
                if announced is not None and announced > max_bytes:
                    raise _TooLarge(announced)
                for block in iter(lambda: response.read1(1 << 16), b""):  # what has arrived: check often
                    received += len(block)
                    if received > max_bytes:
                        raise _TooLarge(received)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"not finished after {timeout:g} s")
                    out.write(block)
                    h.update(block)
        except _TooLarge as e:
            raise RuntimeError(f"downloading {url} failed: the response is over {max_bytes} bytes ({e.args[0]}+); "
                               "check the URL, or raise max_bytes") from None
        except urllib.error.HTTPError as e:
            raise RuntimeError(
                f"downloading {url} failed: HTTP {e.code} {e.reason}; check the URL, "
                "or download the file yourself and use load_text(path)"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RuntimeError(
                f"downloading {url} failed ({reason}); are you offline? "
                "The embedded default_corpus() needs no network"
            ) from None
        if announced is not None and received != announced:
            raise RuntimeError(f"downloading {url} failed: got {received} of {announced} bytes (the connection "
                               "ended early); the partial file was discarded, retry")
        got = h.hexdigest()
        if sha256 is not None and got != sha256.lower():
            raise RuntimeError(
                f"checksum mismatch for {url}: expected sha256 {sha256.lower()}, got {got}; "
                "the download was discarded (retry, or check that the URL is right)"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# --------------------------------------------------------------------------------------------
# Dataset and batches
# --------------------------------------------------------------------------------------------


class TextDataset:
    """A tokenized text split by position: the first (1 - val_fraction) is train, the rest val.

    Splitting by position rather than at random keeps validation text unseen: random windows
    would overlap training windows almost everywhere.
    """

    def __init__(self, text: str, tokenizer: CharTokenizer | None = None, val_fraction: float = 0.1):
        if not text:
            raise ValueError("TextDataset needs non-empty text")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer.from_text(text)
        data = torch.from_numpy(self.tokenizer._encode_array(text))  # (N,) int64
        n_train = int(len(data) * (1.0 - val_fraction))
        self.train = data[:n_train]
        self.val = data[n_train:]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def get_batch(self, split: str, batch_size: int, block_size: int, generator=None, device="cpu"):
        """Random windows of `block_size` tokens: inputs x and next-token targets y, both (B, T) int64.

        Pass a seeded ``torch.Generator`` for a reproducible sequence of batches.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.train if split == "train" else self.val
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size} and {block_size}")
        if block_size >= len(data):
            raise ValueError(
                f"block_size {block_size} needs at least {block_size + 1} tokens in the {split!r} split, "
                f"which has {len(data)}; use a longer text or a smaller block_size"
            )
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
        offsets = starts[:, None] + torch.arange(block_size)  # (B, T)
        x, y = data[offsets], data[offsets + 1]  # (B, T) each: y is x shifted left by one
        if str(device).startswith("cuda"):
            # Pinned host memory lets the copy overlap with compute.
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)
