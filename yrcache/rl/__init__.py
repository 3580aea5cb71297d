"""RL parameter sync: versioned weight publish/subscribe with resharding."""
