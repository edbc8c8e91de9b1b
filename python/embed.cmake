# cmake -DIN=file -DOUT=header -DNAME=symbol -P embed.cmake: the bytes of IN
# as a NUL-terminated C array NAME in OUT (python/kvpipe_aio.py goes into
# the module so).
file(READ "${IN}" hex HEX)
string(REGEX REPLACE "(..)" "0x\\1," bytes "${hex}")
file(WRITE "${OUT}" "/* Generated from ${IN} by embed.cmake. */\nstatic const char ${NAME}[] = {${bytes}0};\n")
