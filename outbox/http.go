package outbox

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Headers the HTTP helper sends with every attempt.
const (
	headerIdempotencyKey = "Idempotency-Key" // the intent's key
	headerToken          = "Pgfence-Token"   // the fencing token that authorised the intent
	headerTopic          = "Pgfence-Topic"
	headerIntentID       = "Pgfence-Intent-Id"
	headerAttempt        = "Pgfence-Attempt" // 1, 2, ...
)

// maxHTTPTimeout is the longest [HTTPConfig].Timeout.
const maxHTTPTimeout = 10 * time.Minute

// HTTPConfig configures [NewHTTPHandler].
type HTTPConfig struct {
	// URL receives a POST per attempt; http or https.
	URL string
	// Client sends the requests. Defaults to a client that does not follow
	// redirects (a redirect answer is a failed attempt): a followed 301,
	// 302 or 303 would turn the POST into a GET.
	Client *http.Client
	// Timeout bounds one attempt, from connecting to the end of the answer;
	// a timeout is a failed attempt, retried. 1ms..10m.
	// Defaults to 10s. Keep it well below the dispatcher's ClaimTTL.
	Timeout time.Duration
	// Header is added to every request (authorization, for example). Names
	// must be HTTP tokens and values free of control characters other than
	// tab ([pgfence.ErrInvalid] otherwise: such a request would fail every
	// attempt). The headers the handler sets itself replace any of the same
	// name.
	Header http.Header
	// Permanent says which answers send the intent to dead at once instead
	// of retrying it. Defaults to treating 422 Unprocessable Content as permanent.
	Permanent func(status int) bool
}

// permanentStatus is the default [HTTPConfig].Permanent: only 422
// Unprocessable Content, which receivers following the Idempotency-Key
// convention send when a key is reused with a different payload. A retry
// cannot fix that.
func permanentStatus(status int) bool { return status == http.StatusUnprocessableEntity }

// HTTPStatusError is a failed attempt's answer: a status other than 2xx.
type HTTPStatusError struct {
	StatusCode int    // the HTTP status of the answer
	Body       string // the start of the answer's body (at most 512 bytes)
}

// Error names the status and the start of the body.
func (e *HTTPStatusError) Error() string {
	return fmt.Sprintf("outbox: receiver answered %d %s: %q", e.StatusCode, http.StatusText(e.StatusCode), e.Body)
}

// NewHTTPHandler returns a [Handler] that POSTs each intent's payload (as
// application/json) to cfg.URL with headers Idempotency-Key (the key),
// Pgfence-Token, Pgfence-Topic, Pgfence-Intent-Id and Pgfence-Attempt. The
// answer decides:
//
//   - 2xx: delivered.
//   - 422 (by default, see [HTTPConfig].Permanent): dead at once, never
//     retried.
//   - Any other status, 409 included, a timeout or a connection error: the
//     attempt failed and is retried after the backoff (dead after the last
//     one). 409 Conflict is what receivers answer while a request with the
//     same key is still being processed: done only if that request
//     succeeds, so the retry asks again.
//
// At most 64 KiB of an answer's body is read. The receiver must apply each
// key's effect once and answer 2xx to a repeated key it has already applied.
func NewHTTPHandler(cfg HTTPConfig) (Handler, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, invalid("outbox.NewHTTPHandler", "HTTPConfig.URL", "%q: want an http or https URL", cutForError(cfg.URL))
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Timeout < time.Millisecond || cfg.Timeout > maxHTTPTimeout {
		return nil, invalid("outbox.NewHTTPHandler", "HTTPConfig.Timeout", "%s not in 1ms..%s", cfg.Timeout, maxHTTPTimeout)
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if cfg.Permanent == nil {
		cfg.Permanent = permanentStatus
	}
	for name, values := range cfg.Header {
		if !validHeaderName(name) {
			return nil, invalid("outbox.NewHTTPHandler", "HTTPConfig.Header", "name %q is not an HTTP token", cutForError(name))
		}
		for _, v := range values {
			if !validHeaderValue(v) {
				return nil, invalid("outbox.NewHTTPHandler", "HTTPConfig.Header", "value of %s contains a control character", name)
			}
		}
	}
	target := u.String()
	// Names in their canonical form, so that the handler's own headers
	// replace a user's of the same name however it was spelled
	// ("idempotency-key" would otherwise go out beside Idempotency-Key).
	header := make(http.Header, len(cfg.Header))
	for name, values := range cfg.Header {
		header[http.CanonicalHeaderKey(name)] = append(header[http.CanonicalHeaderKey(name)], values...)
	}
	return func(ctx context.Context, d Delivery) error {
		ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(d.Payload))
		if err != nil {
			return Permanent(err)
		}
		for k, vs := range header {
			req.Header[k] = append([]string(nil), vs...)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(headerIdempotencyKey, d.Key)
		req.Header.Set(headerToken, strconv.FormatInt(d.Token, 10))
		req.Header.Set(headerTopic, d.Topic)
		req.Header.Set(headerIntentID, strconv.FormatInt(d.ID, 10))
		req.Header.Set(headerAttempt, strconv.Itoa(d.Attempt))
		resp, err := cfg.Client.Do(req)
		if err != nil {
			return fmt.Errorf("outbox: POST %s: %w", u.Redacted(), err)
		}
		defer resp.Body.Close()
		body := io.LimitReader(resp.Body, 64<<10)
		if resp.StatusCode >= 200 && resp.StatusCode < 300 {
			_, _ = io.Copy(io.Discard, body) // lets the connection be reused
			return nil
		}
		head := make([]byte, 512)
		n, _ := io.ReadFull(body, head)
		_, _ = io.Copy(io.Discard, body)
		serr := &HTTPStatusError{StatusCode: resp.StatusCode, Body: strings.ToValidUTF8(string(head[:n]), "?")}
		if cfg.Permanent(resp.StatusCode) {
			return Permanent(serr)
		}
		return serr
	}, nil
}

// validHeaderName reports whether name is an HTTP field name: a token
// (RFC 9110, section 5.6.2).
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// validHeaderValue reports whether v holds no control character but tab
// (RFC 9110, section 5.5): no CR or LF that would end the field.
func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}
