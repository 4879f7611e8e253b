package nccl

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"
)

// IDEnv names the variable IDFromEnv reads: the unique id as 256 hex digits
// (UniqueID.String), set to the same value on every rank.
const IDEnv = "GPUCTX_NCCL_ID"

// String returns the id as 256 hex digits.
func (id UniqueID) String() string { return hex.EncodeToString(id[:]) }

// ParseUniqueID parses 256 hex digits (UniqueID.String).
func ParseUniqueID(s string) (UniqueID, error) {
	var id UniqueID
	b, err := hex.DecodeString(strings.TrimSpace(s))
	if err != nil || len(b) != len(id) {
		return id, fmt.Errorf("nccl: unique id %.20q...: want %d hex digits", s, 2*len(id))
	}
	copy(id[:], b)
	return id, nil
}

// IDFromEnv returns the id in $GPUCTX_NCCL_ID, or ok false when it is unset.
func IDFromEnv() (id UniqueID, ok bool, err error) {
	s, set := os.LookupEnv(IDEnv)
	if !set {
		return id, false, nil
	}
	id, err = ParseUniqueID(s)
	if err != nil {
		return id, true, fmt.Errorf("%s: %w", IDEnv, err)
	}
	return id, true, nil
}

// idMagic starts every id message (protocol version 1).
var idMagic = []byte("gpuctx-nccl-id/1\n")

// ShareID passes the unique id from rank 0 to the other size-1 ranks over TCP,
// for launchers without a store of their own. Protocol: rank 0 listens on
// addr ("host:port"); every other rank connects to it and reads idMagic
// followed by the 128 bytes of the id; rank 0 closes each connection after
// writing. Rank 0 calls make (Lib.UniqueID) once and returns when every rank
// has been served; the others retry connecting until they get the id. Each
// side gives up after timeout with an error, so nothing outlives the call: the
// listener is closed on return.
func ShareID(addr string, size, rank int, timeout time.Duration, make func() (UniqueID, error)) (UniqueID, error) {
	if size < 1 || rank < 0 || rank >= size {
		return UniqueID{}, fmt.Errorf("nccl: ShareID: rank %d of %d", rank, size)
	}
	deadline := time.Now().Add(timeout)
	if rank != 0 {
		return fetchID(addr, deadline)
	}
	id, err := make()
	if err != nil {
		return UniqueID{}, err
	}
	if size == 1 {
		return id, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return UniqueID{}, fmt.Errorf("nccl: ShareID: listening on %s: %w", addr, err)
	}
	defer ln.Close()
	return id, ServeID(ln, id, size-1, deadline)
}

// ServeID writes id to the next clients connections of ln, one each, and
// returns when all are served or at deadline (an error naming how many were
// served). It does not close ln.
func ServeID(ln net.Listener, id UniqueID, clients int, deadline time.Time) error {
	tl, ok := ln.(*net.TCPListener)
	if ok {
		if err := tl.SetDeadline(deadline); err != nil {
			return err
		}
	}
	msg := append(append([]byte(nil), idMagic...), id[:]...)
	for served := 0; served < clients; served++ {
		conn, err := ln.Accept()
		if err != nil {
			return fmt.Errorf("nccl: ShareID: served %d of %d ranks before giving up: %w", served, clients, err)
		}
		_ = conn.SetDeadline(deadline)
		_, err = conn.Write(msg)
		cerr := conn.Close()
		if err = errors.Join(err, cerr); err != nil {
			return fmt.Errorf("nccl: ShareID: sending the id to %s: %w", conn.RemoteAddr(), err)
		}
	}
	return nil
}

// fetchID connects to addr until it gets the id or deadline passes.
func fetchID(addr string, deadline time.Time) (UniqueID, error) {
	var last error
	for wait := 10 * time.Millisecond; ; wait = min(2*wait, 500*time.Millisecond) {
		id, err := readID(addr, deadline)
		if err == nil {
			return id, nil
		}
		last = err
		if time.Now().Add(wait).After(deadline) {
			return UniqueID{}, fmt.Errorf("nccl: ShareID: no id from rank 0 at %s before the deadline: %w", addr, last)
		}
		time.Sleep(wait) // rank 0 may not be listening yet
	}
}

func readID(addr string, deadline time.Time) (UniqueID, error) {
	var id UniqueID
	d := net.Dialer{Deadline: deadline}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		return id, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(deadline)
	buf := make([]byte, len(idMagic)+len(id))
	if _, err := io.ReadFull(conn, buf); err != nil {
		return id, fmt.Errorf("reading the id: %w", err)
	}
	if !bytes.Equal(buf[:len(idMagic)], idMagic) {
		return id, fmt.Errorf("%s did not answer with a gpuctx NCCL id", addr)
	}
	copy(id[:], buf[len(idMagic):])
	return id, nil
}
