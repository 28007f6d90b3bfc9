"""Disjoint sets (union-find with path halving): grouping workers into independent parts."""
from __future__ import annotations


class DisjointSets:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        parent = self.parent
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a, b) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[a] = b

    def items(self):
        """Every element seen, with its set's representative."""
        return [(x, self.find(x)) for x in list(self.parent)]
