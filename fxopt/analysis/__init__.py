"""Analyses shared by every pass: shapes, op matching, aliasing, saved-for-backward, memory, FLOPs.

Passes ask these modules questions; they do not re-derive facts about the graph themselves.
"""
