# Included by every engine recipe's Makefile (a recipe with a proof.toml): `make prove RECIPE=<name>` at the top level
# runs the proof runner in the recipe's folder on the GPU host (the engine and graphpersist installed, see
# recipes/gpu-host/README.md) and rewrites REPORT.md, report.json.gz and phases.png there.
include ../host-pins.mk

.PHONY: prove
prove:
	PYTHONPATH=../../tools$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m gptools.prove . --out out --report REPORT.md --keep-going
