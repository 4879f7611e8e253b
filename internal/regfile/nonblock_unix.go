//go:build unix

package regfile

import "syscall"

const nonBlock = syscall.O_NONBLOCK
