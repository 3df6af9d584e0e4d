# The two commands of the README. Each one sets up everything it needs first (idempotent).
PY ?= python3

.PHONY: setup demo test lint
setup:
	bash scripts/setup.sh

demo: setup
	posttrain demo

test: setup
	$(PY) -m pytest

lint:
	ruff check . && ruff format --check .
