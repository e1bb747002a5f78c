# pgfence developer tasks. `make help` lists them.
SQLC_VERSION        := v1.31.1
STATICCHECK_VERSION := v0.8.2
APIDIFF_VERSION     := v0.0.0-20261113113407-e3970619a1a4
TOOLS_BIN           := $(CURDIR)/.bin
SQLC                := $(TOOLS_BIN)/sqlc
STATICCHECK         := $(TOOLS_BIN)/staticcheck
APIDIFF             := $(TOOLS_BIN)/apidiff

# The modules whose tests `make test` runs: the library, the command and the
# observe adapters (go.work joins them, and bench, whose benchmark has targets
# of its own). PKGS names all their packages for one go command run from this
# directory; `make lint` checks bench's packages too.
MODULES := . cmd/pgfence observe/promobserve observe/otelobserve
PKGS    := ./... $(foreach m,$(filter-out .,$(MODULES)),./$(m)/...)

.PHONY: help demo test test-deps test-containers bench-deps generate verify verify-generated verify-tidy verify-api lint tools bench bench-quick

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

demo: ## run the paused-worker demo (starts a throwaway PostgreSQL if DATABASE_URL is unset)
	go run ./cmd/pgfence demo

test: test-deps $(SQLC) ## run the whole test suite of every module with the race detector (installs sqlc into .bin for the end-to-end tests)
	go test -race $(PKGS)

test-containers: ## run CONTAINER_PKGS' tests on containers for real: a private Docker engine (Debian's docker.io, installed when missing, root) with images built from Debian packages, no registry (scripts/container-tests.sh)
	@bash scripts/container-tests.sh

test-deps: ## install the Debian packages some tests need (pgbouncer, faketime, patroni, etcd-server, prometheus, python3-psycopg) when missing
	@bash scripts/test-deps.sh

$(SQLC):
	GOBIN=$(TOOLS_BIN) CGO_ENABLED=1 go install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)

$(STATICCHECK):
	GOBIN=$(TOOLS_BIN) go install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

$(APIDIFF):
	GOBIN=$(TOOLS_BIN) go install golang.org/x/exp/cmd/apidiff@$(APIDIFF_VERSION)

tools: $(SQLC) $(STATICCHECK) $(APIDIFF) ## install sqlc, staticcheck and apidiff into .bin (not in go.mod)

generate: $(SQLC) ## regenerate internal/dbsqlc from migrations/ and queries/
	$(SQLC) generate

verify-generated: $(SQLC) ## fail if internal/dbsqlc is not what sqlc generates now
	$(SQLC) diff

lint: $(STATICCHECK) ## gofmt, go vet, staticcheck (every module, bench included)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	go vet $(PKGS) ./bench/...
	$(STATICCHECK) $(PKGS) ./bench/...

verify-tidy: ## fail if a module of go.work is missing from it, or its go.mod or go.sum is not tidy
	@bash scripts/verify-tidy.sh

verify-api: $(APIDIFF) ## fail on an incompatible API change since the last release that CHANGELOG's "Changed (breaking)" does not name
	@bash scripts/apicheck.sh

verify: lint verify-tidy verify-generated verify-api ## everything CI checks before the tests

bench-deps: ## install the bench's peers (etcd-server, redis-server) when missing
	@bash scripts/bench-deps.sh

bench: bench-deps ## benchmarks side by side: PostgreSQL limit, pglock, fencedwrite, skiplocked vs etcd, Redis, River (under 10 min)
	cd bench && go run .

bench-quick: bench-deps ## the same in about 3 minutes (results in bench/quick-results, not the committed bench/results)
	cd bench && go run . --quick --out quick-results
