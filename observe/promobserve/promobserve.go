// Package promobserve adapts pgfence's [observe.Metrics] to Prometheus.
//
//	reg := prometheus.NewRegistry()
//	m, err := promobserve.New(reg)
//	locker, err := pglock.New(pool, &pglock.Config{Metrics: m})
//
// Every metric of [observe.Catalog] is registered by [New]; histograms have
// buckets from 0.5 ms to 1 day (86400 s). The context given
// to Add and Observe is ignored unless [ExemplarFromContext] is configured:
// then the labels it returns (a trace id, typically) are attached to the
// sample as an exemplar.
package promobserve

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/model"

	"github.com/pgfence/pgfence/observe"
)

// buckets are the histogram buckets of every *_seconds metric, in seconds:
// from half a millisecond (a local round trip) to a day (a leader's lease
// held, a long wait for a lock).
var buckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400}

// Metrics records pgfence's metrics into Prometheus collectors registered at
// construction. A name outside [observe.Catalog], a call with the wrong
// number of label values, a counter delta that is negative, NaN or +Inf
// (Prometheus panics on a negative one, and one NaN or +Inf spoils the
// series for good), or a NaN observation records nothing (no panic).
//
// A nil *Metrics records nothing: a typed nil put in a Config (var m
// *promobserve.Metrics, left nil when metrics are off) is a no-op.
type Metrics struct {
	counters   map[string]*prometheus.CounterVec
	histograms map[string]*prometheus.HistogramVec
	exemplar   func(context.Context) prometheus.Labels
}

var _ observe.Metrics = (*Metrics)(nil)

// Option configures [New].
type Option func(*Metrics)

// ExemplarFromContext makes every sample carry the exemplar labels fn returns
// for the operation's context (for example {"trace_id": ...} from the span in
// ctx). fn is called on every Add and Observe and must be cheap and safe for
// concurrent use. When it returns no labels, or labels Prometheus would refuse
// (an invalid name, a value that is not UTF-8, more than
// [prometheus.ExemplarMaxRunes] runes in all), the sample is recorded without
// an exemplar. Exemplars are exposed only in the OpenMetrics format
// (promhttp.HandlerOpts{EnableOpenMetrics: true}).
func ExemplarFromContext(fn func(context.Context) prometheus.Labels) Option {
	return func(m *Metrics) { m.exemplar = fn }
}

// New registers every metric of [observe.Catalog] with reg. It returns an
// error when reg is nil (nil, or a nil pointer such as
// (*prometheus.Registry)(nil)) and when one of them is already registered
// there (a second New on the same registry).
func New(reg prometheus.Registerer, opts ...Option) (*Metrics, error) {
	if reg == nil {
		return nil, errors.New("promobserve: nil Registerer")
	}
	if isNil(reg) {
		return nil, fmt.Errorf("promobserve: nil Registerer (a nil %T)", reg)
	}
	m := &Metrics{counters: map[string]*prometheus.CounterVec{}, histograms: map[string]*prometheus.HistogramVec{}}
	for _, o := range opts {
		o(m)
	}
	for _, d := range observe.Catalog {
		var c prometheus.Collector
		switch d.Kind {
		case observe.Counter:
			v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: d.Name, Help: d.Help}, d.Labels)
			m.counters[d.Name], c = v, v
		case observe.Histogram:
			v := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: d.Name, Help: d.Help, Buckets: buckets}, d.Labels)
			m.histograms[d.Name], c = v, v
		default:
			return nil, fmt.Errorf("promobserve: %s: unknown kind %v", d.Name, d.Kind)
		}
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("promobserve: register %s: %w", d.Name, err)
		}
	}
	return m, nil
}

// Add implements observe.Metrics.
func (m *Metrics) Add(ctx context.Context, name string, delta float64, labelValues ...string) {
	if m == nil { // a typed nil *Metrics in a Config: records nothing
		return
	}
	v, ok := m.counters[name]
	if !ok || !(delta >= 0) || math.IsInf(delta, 1) {
		return
	}
	c, err := v.GetMetricWithLabelValues(labelValues...)
	if err != nil {
		return
	}
	if ex := m.exemplarFor(ctx); ex != nil {
		if ea, ok := c.(prometheus.ExemplarAdder); ok {
			ea.AddWithExemplar(delta, ex)
			return
		}
	}
	c.Add(delta)
}

// Observe implements observe.Metrics.
func (m *Metrics) Observe(ctx context.Context, name string, value float64, labelValues ...string) {
	if m == nil {
		return
	}
	v, ok := m.histograms[name]
	if !ok || math.IsNaN(value) {
		return
	}
	h, err := v.GetMetricWithLabelValues(labelValues...)
	if err != nil {
		return
	}
	if ex := m.exemplarFor(ctx); ex != nil {
		if eo, ok := h.(prometheus.ExemplarObserver); ok {
			eo.ObserveWithExemplar(value, ex)
			return
		}
	}
	h.Observe(value)
}

// exemplarFor returns the exemplar labels for ctx, or nil when none are
// configured or Prometheus would refuse them (it panics on those).
func (m *Metrics) exemplarFor(ctx context.Context) prometheus.Labels {
	if m.exemplar == nil || ctx == nil {
		return nil
	}
	ls := m.exemplar(ctx)
	if len(ls) == 0 {
		return nil
	}
	runes := 0
	for name, value := range ls {
		if !model.UTF8Validation.IsValidLabelName(name) || strings.HasPrefix(name, model.ReservedLabelPrefix) || !utf8.ValidString(value) {
			return nil
		}
		runes += utf8.RuneCountInString(name) + utf8.RuneCountInString(value)
	}
	if runes > prometheus.ExemplarMaxRunes {
		return nil
	}
	return ls
}

// isNil reports whether v is nil or holds a nil pointer, map, slice, func,
// channel or interface (as pgfence's internal/nilcheck does; this module
// does not import pgfence's internal packages, whose API may change between
// pgfence versions).
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return rv.IsNil()
	}
	return false
}
