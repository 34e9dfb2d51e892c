"""Report writers: tables, pages and plots from what the suite and the GPU checks left (results.json, logs)."""
