// Package deploycheck tests pgfence's operations assets, the files of the
// repository's deploy/ directory:
//
//   - deploy/prometheus/pgfence-alerts.yml: Prometheus alerting rules, with
//     their promtool unit tests in deploy/prometheus/pgfence-alerts_test.yml;
//   - deploy/grafana/pgfence-dashboard.json: a Grafana dashboard over a
//     Prometheus data source.
//
// The package's tests check them with the real tools and against the code:
// `promtool check rules` and `promtool test rules` (promtool comes with the
// Debian package prometheus; `make test-deps` installs it), the PromQL of
// every alert and panel through promtool's parser, and every metric and label
// name used there against observe.Catalog and the exporter's catalog.
// docs/observability.md explains each alert and panel.
package deploycheck
