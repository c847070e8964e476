# The two set-up commands of the README. Both work on a fresh machine (Python >= 3.10, root
# for the apt step of `make test` where redis-server is missing).
PY ?= python3

.PHONY: demo test

demo:
	$(PY) -m pip install -q -e '.[hf]' && $(PY) -m kvtier.cli demo

test:
	bash scripts/test.sh
