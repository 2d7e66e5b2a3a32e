from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.cache.radix import RadixTree, encode_tokens, normalize_salt


def _build(tree: RadixTree, tokens, salt=None):
    parent = tree.root(salt, create=True)
    for key in tree.page_keys(encode_tokens(tokens)):
        parent = parent.children.get(key) or tree.add_child(parent, key)
    return parent


def _walk(tree: RadixTree, tokens, salt=None):
    return tree.walk(encode_tokens(tokens), salt)


def test_page_keys_cover_whole_pages_only():
    tree = RadixTree(page_size=3)
    keys = tree.page_keys(encode_tokens([1, 2, 3, 4, 5, 6, 7]))
    assert keys == [encode_tokens([1, 2, 3]), encode_tokens([4, 5, 6])]
    assert len(tree.page_keys(encode_tokens([1, 2, 3, 4, 5, 6]), num_pages=1)) == 1
    assert tree.page_keys(encode_tokens([1, 2])) == []


def test_walk_returns_longest_existing_path():
    tree = RadixTree(page_size=2)
    leaf = _build(tree, [1, 2, 3, 4, 5, 6])
    assert [n.depth for n in _walk(tree, [1, 2, 3, 4, 9, 9, 5, 6])] == [0, 1]
    assert _walk(tree, [1, 2, 3, 4, 5, 6, 7])[-1] is leaf
    assert _walk(tree, [1, 2, 3])[-1].tokens == (1, 2)  # the partial page is ignored
    assert _walk(tree, [2, 1]) == []
    assert leaf.path() == _walk(tree, [1, 2, 3, 4, 5, 6])
    assert [n.tokens for n in leaf.path()] == [(1, 2), (3, 4), (5, 6)]


def test_salts_are_separate_namespaces():
    tree = RadixTree(page_size=2)
    _build(tree, [1, 2, 3, 4], salt="tenant-a")
    assert _walk(tree, [1, 2, 3, 4], "tenant-b") == []
    assert _walk(tree, [1, 2, 3, 4], None) == []
    assert len(_walk(tree, [1, 2, 3, 4], "tenant-a")) == 2
    _build(tree, [1, 2], salt="")
    assert len(_walk(tree, [1, 2], None)) == 1  # None and "" are the default namespace
    assert normalize_salt(None) == normalize_salt("") == ""
    with pytest.raises(ValueError):
        normalize_salt(3)


def test_remove_leaf_unlinks_and_drops_empty_root():
    tree = RadixTree(page_size=1)
    leaf = _build(tree, [1, 2], salt="s")
    with pytest.raises(ValueError):
        tree.remove_leaf(leaf.parent)  # not a leaf
    tree.remove_leaf(leaf)
    assert not leaf.alive and tree.num_nodes == 1
    tree.remove_leaf(_walk(tree, [1], "s")[0])
    assert "s" not in tree.roots and tree.num_nodes == 0


def test_add_child_rejects_duplicates_and_wrong_sizes():
    tree = RadixTree(page_size=2)
    root = tree.root(None, create=True)
    tree.add_child(root, encode_tokens([1, 2]))
    with pytest.raises(ValueError):
        tree.add_child(root, encode_tokens([1, 2]))
    with pytest.raises(ValueError, match="8 bytes"):
        tree.add_child(root, encode_tokens([1, 2, 3]))
    with pytest.raises(ValueError):
        tree.add_child(root, (1, 2))


def test_iter_nodes_visits_every_page_parent_first():
    tree = RadixTree(page_size=1)
    _build(tree, [1, 2, 3])
    _build(tree, [1, 4])
    _build(tree, [5], salt="x")
    seen = []
    for node in tree.iter_nodes():
        assert node.parent.is_root or node.parent in seen
        seen.append(node)
    assert len(seen) == tree.num_nodes == 5


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 70000],
        (1, 2, 70000),
        torch.tensor([1, 2, 70000]),
        torch.tensor([1, 2, 70000], dtype=torch.int32),
        np.array([1, 2, 70000], dtype=np.uint32),
    ],
    ids=["list", "tuple", "tensor-int64", "tensor-int32", "ndarray-uint32"],
)
def test_every_token_container_gives_the_same_key(tokens):
    assert encode_tokens(tokens) == encode_tokens([1, 2, 70000])
    tree = RadixTree(page_size=3)
    _build(tree, [1, 2, 70000])
    assert len(tree.walk(encode_tokens(tokens), None)) == 1


@pytest.mark.parametrize(
    "tokens",
    [torch.zeros(2, 3, dtype=torch.long), np.array([1.0, 2.0]), [1, 2**40], [1, "a"]],
    ids=["2-D", "float", "int64-overflow", "str"],
)
def test_bad_tokens_raise(tokens):
    with pytest.raises(ValueError):
        encode_tokens(tokens)
