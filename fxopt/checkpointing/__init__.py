"""Activation checkpointing: the step profile (facts), the planner, and its two lowerings."""
