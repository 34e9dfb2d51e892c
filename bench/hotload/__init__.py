"""The hot-load study: scenario 2 of the suite, and `python bench/hotload/hotload.py run` on its own."""
