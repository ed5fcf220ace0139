from stacklens.introspect.demangle import demangle


def test_itanium_names_demangle_like_cxxfilt():
    assert demangle("_ZN2at6native3fooEv") == "at::native::foo()"
    assert demangle("_ZNSt6vectorIiSaIiEE9push_backERKi") == \
        "std::vector<int, std::allocator<int> >::push_back(int const&)"


def test_plain_and_malformed_names_come_back_unchanged():
    assert demangle("sm80_xmma_gemm_f32f32") == "sm80_xmma_gemm_f32f32"
    assert demangle("_Z") == "_Z"
    assert demangle("_Zbogus!!") == "_Zbogus!!"
    assert demangle("") == ""
