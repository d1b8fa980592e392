"""WebShop product search on bm25s, approximating the Lucene index WebShop ships (spec §5).

FedAgent's default backend is pyserini/Lucene (a JVM, ~14 GB per env). Here the same documents are
scored by bm25s in "lucene" mode with pyserini's parameters (k1 = 0.9, b = 0.4):

* one document per product: lowercase(Title + " " + Description + " " + first bullet + " " +
  option text), option text being ``"size: x-small, small, and color: black, red"``;
* analysis approximating Lucene's English analyzer: UAX#29-like word split ("x-small" -> x, small;
  "3.5mm" and "women's" stay whole), possessive 's removed, lowercase, the 33 Lucene stopwords
  dropped, Porter stemming (PyStemmer "porter", not Porter2);
* only documents matching at least one query term are returned, ordered by (-score, load order) with a
  stable sort (Lucene's tie rule), cut to top-K.

An allowed-ASIN set (a client's catalogue) filters the ranked top-K *afterwards* without refilling,
as FedAgent's catalog split does. Not reproduced: Lucene's one-byte quantisation of document lengths
above 24 tokens, so scores of long documents differ slightly from Lucene's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

#: SEARCH_RETURN_N: upstream's default top-K (FedAgent exports 200 for val and env-variant services).
DEFAULT_TOP_K = 50
LUCENE_K1 = 0.9
LUCENE_B = 0.4

#: Lucene's default English stopword set (33 words).
LUCENE_STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there "
    "these they this to was will with".split()
)

# Word runs; letters stay joined across ' . : (UAX#29 MidLetter/MidNumLet), digits across , . ; '
# (MidNum/MidNumLet). A hyphen or slash always splits, as in UAX#29.
_TOKEN_RE = re.compile(
    r"\w+(?:(?:(?<=[^\W\d_])['’.:·](?=[^\W\d_])|(?<=\d)[.,;'’](?=\d))\w+)*"
)
_POSSESSIVE_RE = re.compile(r"['’][sS]$")


class Searcher(Protocol):
    """What the engine needs from a search backend: ranked ASINs, optionally catalogue-filtered."""

    def search(
        self, query: str, allowed: Collection[str] | None = None, top_k: int | None = None
    ) -> list[str]: ...


class _Stemmer:
    """Porter stemmer from PyStemmer, loaded once (the C extension is fast and thread-safe per call)."""

    _instance: Any = None

    @classmethod
    def stem_words(cls, words: list[str]) -> list[str]:
        if cls._instance is None:
            try:
                import Stemmer
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise ImportError("WebShop search needs PyStemmer: pip install PyStemmer") from exc
            cls._instance = Stemmer.Stemmer("porter")
        return list(cls._instance.stemWords(words))


def analyze(text: str) -> list[str]:
    """Lucene-English-like analysis of ``text``: tokens, possessive removal, lowercase, stopwords, Porter."""
    tokens = []
    for match in _TOKEN_RE.finditer(text):
        token = _POSSESSIVE_RE.sub("", match.group(0)).lower()
        if token and token not in LUCENE_STOPWORDS:
            tokens.append(token)
    return _Stemmer.stem_words(tokens)


def option_text(options: Mapping[str, Sequence[str]]) -> str:
    """``"size: x-small, small, and color: black, red"``: the options part of an indexed document."""
    return ", and ".join(f"{group}: {', '.join(values)}" for group, values in options.items())


def document_text(product: Mapping[str, Any]) -> str:
    """The indexed text of one product (Title, Description, first bullet, option text), lowercased."""
    bullets = product.get("BulletPoints") or []
    first_bullet = bullets[0] if bullets and bullets[0] is not None else ""
    parts = [product.get("Title") or "", product.get("Description") or "", first_bullet,
             option_text(product.get("options") or {})]
    return " ".join(str(p) for p in parts).lower()


class BM25Search:
    """Lucene-style BM25 over a product list; :meth:`search` returns ranked ASINs."""

    def __init__(self, products: Sequence[Mapping[str, Any]]) -> None:
        # bm25s runs a JAX op when it is imported (its top-k backend probe), and JAX on a GPU node
        # reserves 75% of the GPU's memory at its first op. Any process that builds a WebShop world
        # imports it (the ClientApp counting goals for a partition, the ServerApp's pre-flight
        # check, the env services), so on the H200 two ClientApp processes took 30 and 105 GiB and
        # no verl session could start (docs/gpu.md §7). The search is numpy; JAX stays on the CPU
        # unless the user chose its platform.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import bm25s

        self.top_k = DEFAULT_TOP_K  # a search call without its own top_k
        self.asins: list[str] = [str(p["asin"]) for p in products]
        self._retriever = bm25s.BM25(method="lucene", k1=LUCENE_K1, b=LUCENE_B, dtype="float64")
        corpus = [analyze(document_text(p)) for p in products]
        self._retriever.index(corpus, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query`` (repeated query terms count, as in Lucene)."""
        tokens = analyze(query)
        if not tokens or not self.asins:
            return np.zeros(len(self.asins))
        return np.asarray(self._retriever.get_scores(tokens), dtype=np.float64)

    def search(
        self, query: str, allowed: Collection[str] | None = None, top_k: int | None = None
    ) -> list[str]:
        """The top-K matching ASINs for ``query``, then only those in ``allowed`` (if given), in rank order.

        ``top_k`` overrides the instance's K for this call, so one index serves services with
        different SEARCH_RETURN_N.

        Filtering happens after the cut to top-K and ranks are not refilled (FedAgent's catalog
        filter), so a client catalogue can see fewer than K results.
        """
        scores = self.scores(query)
        # Stable sort on -score keeps load order among ties, like Lucene's doc-id tie break.
        order = np.argsort(-scores, kind="stable")
        k = self.top_k if top_k is None else top_k
        ranked = [self.asins[i] for i in order[:k] if scores[i] > 0]
        if allowed is None:
            return ranked
        return [a for a in ranked if a in allowed]


#: FedAgent's in-memory field list; ``description`` and ``features`` are not product keys (spec §5
#: quirk), so in effect the default indexes the name twice plus all bullets.
IN_MEMORY_FIELDS: tuple[str, ...] = ("name", "Title", "description", "features", "BulletPoints")
_WORD_RE = re.compile(r"\b\w+\b")


def in_memory_document_text(product: Mapping[str, Any], fields: Sequence[str]) -> str:
    """FedAgent's in-memory document: truthy fields (lists space-joined), stripped; the name if empty."""
    parts = []
    for name in fields:
        value = product.get(name)
        if value:
            parts.append(" ".join(str(v) for v in value) if isinstance(value, list) else str(value))
    text = " ".join(parts).strip()
    return text if text else str(product.get("name"))


class InMemoryBM25:
    """FedAgent's ``InMemoryBM25Searcher`` (rank_bm25 ``BM25Okapi`` semantics), computed with numpy.

    Used by FedAgent's environment-level variants (field subsets, k1/b reweighting, look-alikes).
    Unlike the Lucene-style index every document gets a score, so results always hold min(K, N)
    ASINs; ties are broken by load order (numpy's unstable argsort upstream may differ there).
    """

    def __init__(
        self,
        products: Sequence[Mapping[str, Any]],
        *,
        fields: Sequence[str] = IN_MEMORY_FIELDS,
        k1: float = 1.2,
        b: float = 0.75,
    ) -> None:
        self.top_k, self.k1, self.b = DEFAULT_TOP_K, k1, b  # top_k: a search call without its own
        self.asins: list[str] = [str(p["asin"]) for p in products]
        docs = [_WORD_RE.findall(in_memory_document_text(p, fields).lower()) for p in products]
        n = len(docs)
        self.doc_len = np.array([len(d) for d in docs], dtype=np.float64)
        self.avgdl = float(self.doc_len.mean()) if n else 0.0
        self._postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        tfs: dict[str, dict[int, int]] = {}
        for i, doc in enumerate(docs):
            for token in doc:
                row = tfs.setdefault(token, {})
                row[i] = row.get(i, 0) + 1
        raw_idf = {t: float(np.log((n - len(row) + 0.5) / (len(row) + 0.5))) for t, row in tfs.items()}
        # rank_bm25: a negative idf becomes epsilon (0.25) x the mean of all raw idfs (negatives included).
        floor = 0.25 * (sum(raw_idf.values()) / len(raw_idf)) if raw_idf else 0.0
        self.idf = {t: (v if v >= 0 else floor) for t, v in raw_idf.items()}
        for token, row in tfs.items():
            ids = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
            self._postings[token] = (ids, np.fromiter(row.values(), dtype=np.float64, count=len(row)))

    def scores(self, query: str) -> np.ndarray:
        """BM25Okapi score of every document (repeated query tokens count; unknown tokens add 0)."""
        tokens = _WORD_RE.findall(query.lower())
        out = np.zeros(len(self.asins), dtype=np.float64)
        if not self.asins:
            return out
        norm = self.k1 * (1 - self.b + self.b * self.doc_len / self.avgdl) if self.avgdl else self.k1
        for token in tokens:
            posting = self._postings.get(token)
            if posting is None:
                continue
            ids, tf = posting
            denom = tf + (norm[ids] if isinstance(norm, np.ndarray) else norm)
            out[ids] += self.idf[token] * tf * (self.k1 + 1) / denom
        return out

    def search(
        self, query: str, allowed: Collection[str] | None = None, top_k: int | None = None
    ) -> list[str]:
        """The top min(K, N) ASINs by score (zero scores included), then those in ``allowed``."""
        if not _WORD_RE.search(query.lower()):
            return []
        scores = self.scores(query)
        order = np.argsort(-scores, kind="stable")
        k = self.top_k if top_k is None else top_k
        ranked = [self.asins[i] for i in order[:k]]
        return ranked if allowed is None else [a for a in ranked if a in allowed]
