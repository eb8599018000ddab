"""Model runtime: plain torch modules per architecture family."""
