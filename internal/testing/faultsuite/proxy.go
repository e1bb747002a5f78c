package faultsuite

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Mode is what a [Proxy] does with the traffic it carries.
type Mode int

const (
	// Pass forwards every chunk at once.
	Pass Mode = iota
	// Blackhole keeps every connection open but forwards nothing, either
	// way: chunks are held, in order, and delivered when the mode changes
	// back (as TCP retransmits once a partition heals). New connections are
	// accepted and dialled through, and then hang the same way.
	Blackhole
	// Drop closes every connection, and closes new ones as soon as they
	// are accepted. Chunks held by a blackhole are discarded.
	Drop
	// Delay forwards each chunk once it is Delay old (latency added per
	// chunk, in each direction, order kept).
	Delay
)

// String names the mode.
func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Blackhole:
		return "blackhole"
	case Drop:
		return "drop"
	case Delay:
		return "delay"
	}
	return "unknown"
}

// Proxy is an in-process TCP proxy between PostgreSQL clients and a server
// that injects network faults ([Mode]). Point a client at [Proxy.Addr]
// instead of the server. It is safe for concurrent use.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	mode    Mode
	delay   time.Duration
	armed   *Mode         // switch to *armed after the next client→server chunk is written
	changed chan struct{} // closed and replaced on every change of mode
	pairs   map[*pair]struct{}
	closed  bool
	refuse  bool // close new connections at once (see RefuseNew)
	wg      sync.WaitGroup
}

// pair is one proxied connection: the client's side and the server's side.
type pair struct {
	client, server net.Conn
	done           chan struct{}
	once           sync.Once
	ended          atomic.Int32 // directions that finished
}

func (c *pair) close() {
	c.once.Do(func() {
		close(c.done)
		_ = c.client.Close()
		_ = c.server.Close()
	})
}

// chunk is one read from a socket, with the time it was read.
type chunk struct {
	data []byte
	at   time.Time
}

// NewProxy listens on 127.0.0.1 (a free port) and forwards every connection
// to target ("host:port"), in mode [Pass]. Close it when done.
func NewProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, changed: make(chan struct{}), pairs: map[*pair]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the proxy's listening address ("127.0.0.1:port").
func (p *Proxy) Addr() *net.TCPAddr { return p.ln.Addr().(*net.TCPAddr) }

// Set switches every connection, current and future, to mode; delay is the
// latency of [Delay]. [Drop] closes the current connections at once. A
// switch cancels a pending [Proxy.ArmAfterRequest].
func (p *Proxy) Set(mode Mode, delay time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = nil
	p.setLocked(mode, delay)
}

func (p *Proxy) setLocked(mode Mode, delay time.Duration) {
	p.mode, p.delay = mode, delay
	close(p.changed)
	p.changed = make(chan struct{})
	if mode == Drop {
		for c := range p.pairs {
			c.close()
			delete(p.pairs, c)
		}
	}
}

// ArmAfterRequest makes the proxy switch to mode right after it has written
// the next client→server chunk to the server: the request reaches the
// server, and its reply is then blackholed or its connection dropped.
func (p *Proxy) ArmAfterRequest(mode Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = &mode
}

// RefuseNew makes the proxy close every new connection at once (on) or accept
// them again (off), whatever the mode; current connections are not affected.
// A late-delivery scenario uses it so that only the held request's own
// connection reaches the server when the network heals: pgx's cancel request,
// sent on a new connection when the caller gives up, would otherwise be held
// with it and released at the same moment, racing the request it cancels.
func (p *Proxy) RefuseNew(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = on
}

// Mode returns the current mode.
func (p *Proxy) Mode() Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode
}

// Close stops listening, closes every connection and waits for the
// proxy's goroutines to end.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.pairs {
		c.close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		conn, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		p.mu.Lock()
		refuse := p.closed || p.mode == Drop || p.refuse
		p.mu.Unlock()
		if refuse {
			_ = conn.Close()
			continue
		}
		server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			_ = conn.Close()
			continue
		}
		c := &pair{client: conn, server: server, done: make(chan struct{})}
		p.mu.Lock()
		if p.closed || p.mode == Drop || p.refuse {
			p.mu.Unlock()
			c.close()
			continue
		}
		p.pairs[c] = struct{}{}
		p.wg.Add(4)
		p.mu.Unlock()
		up := make(chan chunk, 1024)
		down := make(chan chunk, 1024)
		go p.read(c, c.client, up)
		go p.write(c, c.server, up, true)
		go p.read(c, c.server, down)
		go p.write(c, c.client, down, false)
	}
}

// read reads src until it fails, queueing what it reads on out. It keeps
// reading in every mode, so a closed socket is noticed at once.
func (p *Proxy) read(c *pair, src net.Conn, out chan<- chunk) {
	defer p.wg.Done()
	defer close(out)
	for {
		buf := make([]byte, 32<<10)
		n, err := src.Read(buf)
		if n > 0 {
			select {
			case out <- chunk{data: buf[:n], at: time.Now()}:
			case <-c.done:
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// write forwards the chunks of in to dst as the mode allows. When in is
// exhausted (its source closed) it half-closes dst, so the other end sees
// the end of the stream after every chunk held before it. If the client
// is gone, what the server still sends is discarded; if the server is gone,
// the pair is closed. The pair is closed when both directions are done.
func (p *Proxy) write(c *pair, dst net.Conn, in <-chan chunk, toServer bool) {
	defer p.wg.Done()
	defer p.directionDone(c)
	broken := false
	for {
		var ch chunk
		var ok bool
		select {
		case ch, ok = <-in:
			if !ok {
				if tcp, isTCP := dst.(*net.TCPConn); isTCP && !broken {
					_ = tcp.CloseWrite()
				}
				return
			}
		case <-c.done:
			return
		}
		if broken {
			continue
		}
		if toServer && p.fireArmed(c, dst, ch) {
			continue
		}
		for sent := false; !sent; {
			p.mu.Lock()
			mode, delay, changed := p.mode, p.delay, p.changed
			p.mu.Unlock()
			switch mode {
			case Blackhole:
				select {
				case <-changed:
				case <-c.done:
					return
				}
				continue
			case Drop:
				return
			case Delay:
				if wait := time.Until(ch.at.Add(delay)); wait > 0 {
					t := time.NewTimer(wait)
					select {
					case <-t.C:
					case <-changed:
						t.Stop()
						continue
					case <-c.done:
						t.Stop()
						return
					}
				}
			}
			if _, err := dst.Write(ch.data); err != nil {
				if toServer {
					c.close()
					return
				}
				broken = true
			}
			sent = true
		}
	}
}

// fireArmed handles a client→server chunk when [Proxy.ArmAfterRequest] is
// pending: it blackholes every connection first (so no reply can slip
// through), writes the chunk to the server anyway, and then switches to the
// armed mode. It reports whether it did.
func (p *Proxy) fireArmed(c *pair, dst net.Conn, ch chunk) bool {
	p.mu.Lock()
	if p.armed == nil {
		p.mu.Unlock()
		return false
	}
	mode := *p.armed
	p.armed = nil
	p.setLocked(Blackhole, p.delay)
	p.mu.Unlock()
	if _, err := dst.Write(ch.data); err != nil {
		c.close()
	}
	if mode != Blackhole {
		p.mu.Lock()
		p.setLocked(mode, p.delay)
		p.mu.Unlock()
	}
	return true
}

// directionDone closes c and forgets it once both of its directions ended.
func (p *Proxy) directionDone(c *pair) {
	if c.ended.Add(1) < 2 {
		return
	}
	c.close()
	p.mu.Lock()
	delete(p.pairs, c)
	p.mu.Unlock()
}
