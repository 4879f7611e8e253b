package bench

// Error is a failure with the advice to print after it (the CLI prints it as
// "what: cause: fix").
type Error struct {
	What, Fix string
	Err       error
}

func (e *Error) Error() string {
	s := e.What
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	if e.Fix != "" {
		s += ": " + e.Fix
	}
	return s
}

func (e *Error) Unwrap() error { return e.Err }

// Fail returns an *Error.
func Fail(what, fix string, err error) error { return &Error{What: what, Fix: fix, Err: err} }
