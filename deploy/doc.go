// Package deploy holds pgfence's operations assets, which are files rather
// than Go code:
//
//   - prometheus/pgfence-alerts.yml: Prometheus alerting rules, with their
//     promtool unit tests in prometheus/pgfence-alerts_test.yml;
//   - grafana/pgfence-dashboard.json: a Grafana dashboard over a Prometheus
//     data source.
//
// The package's tests check them with the real tools and against the code:
// `promtool check rules` and `promtool test rules` (promtool comes with the
// Debian package prometheus; `make test-deps` installs it), the PromQL of
// every alert and panel through promtool's parser, and every metric and label
// name used there against observe.Catalog and the exporter's catalog.
// docs/observability.md explains each alert and panel.
package deploy
